"""The runner's launches: each device program that takes host inputs, and their replay.

Owns queueing the forward, the sampler, a block copy and a proposal on the device
with the arrays they take, and, on a multi-host leader, publishing each
(`publisher`) so that its followers run the same (`apply`, `follow`). `ModelRunner`
mixes this in; preparing the inputs is its own (`forward`, `sample`, `propose`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jvllm.layers import sampler
from jvllm.layers.attention import KVCache
from jvllm.models.loader import LoadedModel
from jvllm.parallel.step_channel import StepMessage, StepPublisher
from jvllm.runner.block_copies import BlockCopier
from jvllm.runner.draft_feed import padded_sources, place_drafts_fn
from jvllm.runner.drafter import Drafter, ProposalInputs
from jvllm.runner.input_batch import BatchShape
from jvllm.runner.lora_weights import DeviceLoRA
from jvllm.runner.programs import Program

# A forward's logits, hidden states, last input tokens and shape (`_run_forward`).
Forward = tuple[jax.Array, jax.Array, jax.Array, BatchShape]


class Launches:
    """The launching half of `ModelRunner` (whose `__init__` sets these attributes)."""

    model: LoadedModel
    drafter: Drafter | None
    caches: list[KVCache]
    publisher: StepPublisher | None
    group_rows: int | None
    logits_buffer: jax.Array | None  # [max_rows, V] float32 (grouped sampling)
    allow_all: jax.Array | None  # [max_rows, words] int32 (grouped sampling)
    last_sampled: jax.Array  # [R] int32
    draft_probs: jax.Array | None  # [Q, V] float32
    features: jax.Array | None  # [R, H]
    proposed: jax.Array | None  # [S, k] int32: the last proposal's drafts
    blocks: BlockCopier
    lora: DeviceLoRA | None
    _last_forward: Forward | None
    _forward_fn: Program
    _sample_fn: Program
    _mask_fn: Program
    _all_logprobs_fn: Program
    _propose_fn: Program
    _put: Callable[[Any], Any]

    def _publish(self, op: str, statics: dict[str, int], **arrays: np.ndarray | None) -> None:
        """Only on a multi-host leader (callers check `publisher` first: one step's
        message costs dict building the single-host path does not need)."""
        assert self.publisher is not None
        present = {k: v for k, v in arrays.items() if v is not None}
        self.publisher.publish(StepMessage(op, statics, present))

    def _launch_forward(
        self, packed: np.ndarray, shape: BatchShape, mm: dict[str, Any] | None = None
    ) -> None:
        """`mm`: a vision-language step's extra inputs (`encoder_runner.step_inputs`)."""
        if self.publisher is not None:
            self._publish("forward", dataclasses.asdict(shape), packed=packed)
        draft_params = self.drafter.model.params if self.drafter is not None else None
        logits, hidden, self.caches, last_input, features = self._forward_fn(
            self.model.params,
            self.caches,
            self._put(packed),
            self.last_sampled,
            shape=shape,
            draft_params=draft_params,
            logits_buffer=self.logits_buffer,
            **({} if self.lora is None else {"lora_weights": self.lora.weights}),
            **{name: self._put(value) for name, value in (mm or {}).items()},
        )
        if self.logits_buffer is not None:
            self.logits_buffer = logits
        if features is not None:
            self.features = features
        self._last_forward = (logits, hidden, last_input, shape)

    def _launch_sample(
        self,
        md: sampler.SamplingMetadata,
        bitmask: np.ndarray | None = None,
        targets: np.ndarray | None = None,
    ) -> tuple[sampler.SamplerOutput, tuple[jax.Array, ...] | None]:
        """Samples the last forward's logits rows (masked by `bitmask` when given) and,
        with `targets`, scores its every position (prompt logprobs)."""
        if self.publisher is not None:
            fields = {f.name: getattr(md, f.name) for f in dataclasses.fields(md)}
            self._publish("sample", {}, bitmask=bitmask, targets=targets, **fields)
        assert self._last_forward is not None
        logits, hidden, last_input, _ = self._last_forward
        mask = ()  # grouped sampling: the bitmask, applied inside the sampler's groups
        if self.group_rows is not None:
            mask = (self.allow_all if bitmask is None else self._put(bitmask),)
        elif bitmask is not None:
            logits = self._mask_fn(logits, self._put(bitmask))
        out, self.last_sampled = self._sample_fn(
            logits, self._put(md), last_input, self.draft_probs, *mask
        )
        scored = None
        if targets is not None:
            scored = self._all_logprobs_fn(self.model.params, hidden, self._put(targets))
        return out, scored

    def _launch_copy(self, pairs: np.ndarray) -> None:
        if self.publisher is not None:
            self._publish("copy", {}, pairs=pairs)
        src, dst = self._put(pairs)
        self.caches = self.blocks.copy_fn(self.caches, src, dst)

    def _launch_propose(self, inputs: ProposalInputs) -> jax.Array:
        if self.publisher is not None:
            self._publish("propose", {}, **inputs._asdict())
        assert self.drafter is not None
        drafts, self.draft_probs, self.caches = self._propose_fn(
            self.drafter.model.params,
            self.model.params,
            self.caches,
            self._put(inputs),
            self.features,
        )
        self.proposed = drafts
        return drafts

    def _launch_place_drafts(self, sources: np.ndarray) -> None:
        """The step's drafts (flat indices into the last proposal, in row order) into
        `last_sampled`, where the forward's draft positions read them (`draft_feed`)."""
        if self.publisher is not None:
            self._publish("place_drafts", {}, sources=sources)
        assert self.proposed is not None
        if getattr(self, "_place_fn", None) is None:
            self._place_fn = place_drafts_fn(self.last_sampled.sharding)
        padded = padded_sources(sources, self.last_sampled.shape[0])
        self.last_sampled = self._place_fn(self.proposed, self._put(padded))

    def apply(self, message: StepMessage) -> None:
        """Runs one program a multi-host leader published (on a follower)."""
        a = message.arrays
        if message.op == "forward":
            self._launch_forward(a["packed"], BatchShape(**message.statics))
        elif message.op == "sample":
            names = [f.name for f in dataclasses.fields(sampler.SamplingMetadata)]
            md = sampler.SamplingMetadata(**{name: a[name] for name in names})
            self._launch_sample(md, a.get("bitmask"), a.get("targets"))
        elif message.op == "copy":
            self._launch_copy(a["pairs"])
        elif message.op == "propose":
            self._launch_propose(ProposalInputs(**a))
        elif message.op == "place_drafts":
            self._launch_place_drafts(a["sources"])
        else:
            raise ValueError(f"unknown step message {message.op!r}")

    def follow(self, receive: Callable[[], StepMessage]) -> int:
        """A follower's loop: runs the leader's programs in order until it says stop;
        returns how many it ran."""
        count = 0
        while (message := receive()).op != "stop":
            self.apply(message)
            count += 1
        jax.block_until_ready(self.caches)
        return count
