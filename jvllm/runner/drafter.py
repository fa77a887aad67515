"""Speculative decoding's proposers on the device: a draft model, EAGLE or Medusa heads.

Each owns the two programs it adds to a step, both traced into the runner's jitted
functions:
- `write_kv`, inside the target's forward, over the target's own packed batch (same
  positions, slots, block tables), so the proposer's cache covers every position the
  target's does, in the same blocks (copy-on-write, swaps and the prefix cache's host
  tier move both, as one list of layers);
- `propose`, after the step: k unrolled single-token steps per row, each writing its
  K/V into slots the scheduler allocated ahead and drawing the next draft token from
  q = softmax(logits / temperature) (one-hot at the argmax for greedy rows) with the
  request's seed at that output index. The drafts go to the host, the q rows stay on
  the device for the target's rejection sampler.

A draft model (`Drafter`) is a whole smaller model: `write_kv` runs it over the batch's
tokens, and `propose` decodes from each row's newest token at position p.

An EAGLE-1 head (`EagleDrafter`, `jvllm.models.eagle`) reads the target instead: its
entry at position i is computed from the token at i + 1 and the target's final hidden
state at i, and it predicts the feature (hence the token) one further on. `write_kv`
pairs each batch position with the next token in its row; a row's last position has
none in the batch, so `propose` first rewrites that entry (position p - 1, where the
newest token p was sampled from) with the newest token and the target's feature there,
then feeds its own output features forward for the remaining steps. A row that takes
no drafts (a prefill chunk short of the prompt's end, a sequence one token from its
limit) still gets that first step, so its next chunk or row attends to a true entry.

An EAGLE-3 head (`Eagle3Drafter`, `jvllm.models.eagle3`) proposes as EAGLE-1 does, but
its features are three target layers' inputs (`aux_layers`, `[T, 3H]`) fused by its
`fc`, it feeds its own output (before its final norm) forward, and it scores with its
own draft vocabulary mapped to target ids.

DeepSeek-V3's MTP layer (`MTPDrafter`, `jvllm.models.deepseek_mtp`) proposes as EAGLE-1
does from the target's final hidden states, feeding its own output forward, and scores
with its shared head.

Medusa heads (`MedusaDrafter`, `jvllm.models.medusa`) have no cache: `propose` scores
each row's feature (the target's hidden state at the logits row its newest token came
from) with every head at once and takes each head's argmax, with a one-hot q.

The proposer's cache shares the target's block size and block count; its own layer,
head and dimension counts are free.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jvllm.layers.attention import AttentionMetadata, KVCache
from jvllm.layers.sampler import argmax_rows, inverse_cdf_draw
from jvllm.models.loader import LoadedModel
from jvllm.runner.input_batch import ModelInput
from jvllm.sampling_params import SAMPLING_EPS

# Folded into the request's key at an output index for the draft's own draw, which must
# not repeat the target's draw at the same index.
_DRAFT_TAG = 0xD1AF


class ProposalInputs(NamedTuple):
    """One proposal call's rows, padded to a row bucket (numpy on the host)."""

    tokens: Any  # i32[S]: each row's newest token
    positions: Any  # i32[S]: the first step's position (see DraftRow.position)
    tables: Any  # i32[S, W]: block tables covering the steps' positions
    limits: Any  # i32[S]: draft tokens wanted (0 for padding rows), at most k
    seeds: Any  # u32[S]
    steps: Any  # i32[S]: output tokens before the newest one's successor
    temperature: Any  # f32[S]
    feature_rows: Any  # i32[S]: EAGLE: the step's logits row the newest token came from


# (token [S], position [S], attention metadata, carried state) -> (hidden [S, H], carry,
# caches): one single-token step of a proposer; its hidden states go through `logits`.
StepFn = Callable[[jax.Array, jax.Array, AttentionMetadata, Any, list[KVCache]], Any]


class Drafter:
    """A draft model: a smaller model of the same vocabulary, with its own KV layers."""

    # Whether `propose` reads the step's logits rows' hidden states (`features`).
    uses_features = False
    # EAGLE-3: the target layers whose inputs replace the final hidden states as the
    # features `write_kv` and `propose` read (concatenated, `[T, 3H]`).
    aux_layers: tuple[int, ...] = ()

    def __init__(self, loaded: LoadedModel, num_speculative_tokens: int, block_size: int) -> None:
        self.model = loaded
        self.k = num_speculative_tokens
        self.block_size = block_size

    def write_kv(
        self,
        params: Any,
        target_params: Any,
        caches: list[KVCache],
        inp: ModelInput,
        hidden: jax.Array,
    ) -> list[KVCache]:
        """The draft's K/V for the target's batch (its hidden states are not used)."""
        _, caches = self.model.module.apply(
            {"params": params}, inp.token_ids, inp.positions, caches, inp.attn
        )
        return caches

    def propose(
        self,
        params: Any,
        target_params: Any,
        caches: list[KVCache],
        rows: ProposalInputs,
        features: jax.Array,
    ) -> tuple[jax.Array, jax.Array, list[KVCache]]:
        """k draft tokens per row `[S, k]`, their distributions `[S * k, V]` (row r's
        i-th at r * k + i) and the updated cache, from each row's newest token at its
        position."""
        module = self.model.module

        def step(token, pos, attn, carry, caches):
            hidden, caches = module.apply({"params": params}, token, pos, caches, attn)
            return hidden, carry, caches

        score = lambda h: module.apply({"params": params}, h, method=module.logits)
        return draft_steps(self.k, self.block_size, rows, caches, step, score, None, False)


class EagleDrafter(Drafter):
    """An EAGLE-1 head over the target's hidden states (see the module docstring)."""

    uses_features = True

    def __init__(
        self,
        head: LoadedModel,
        target: LoadedModel,
        num_speculative_tokens: int,
        block_size: int,
    ) -> None:
        super().__init__(head, num_speculative_tokens, block_size)
        self.target = target

    def _embed(self, target_params: Any, token_ids: jax.Array) -> jax.Array:
        module = self.target.module
        embed = lambda m, ids: m.model.embed_tokens(ids)
        return module.apply({"params": target_params}, token_ids, method=embed)

    def _head(self, params: Any, *args: Any, method: str | None = None) -> Any:
        module = self.model.module
        return module.apply({"params": params}, *args, method=method or "__call__")

    def _embeds(self, params: Any, target_params: Any, token_ids: jax.Array) -> jax.Array:
        """The head's input embeddings: its own table where it has one, else the target's."""
        if getattr(self.model.module, "own_embedding", False):
            return self._head(params, token_ids, method="embed")
        return self._embed(target_params, token_ids)

    def _fuse(self, params: Any, hidden: jax.Array) -> jax.Array:
        """The head's feature from the target's hidden states (EAGLE-1: as they are)."""
        return hidden

    def _score(self, params: Any, target_params: Any, x: jax.Array) -> jax.Array:
        """Logits of the head's output (EAGLE-1: the target's lm_head)."""
        target = self.target.module
        return target.apply({"params": target_params}, x, method=target.logits)

    def write_kv(
        self,
        params: Any,
        target_params: Any,
        caches: list[KVCache],
        inp: ModelInput,
        hidden: jax.Array,
    ) -> list[KVCache]:
        """Entry i from the next token of the batch and the target's feature at i; each
        row's last entry pairs with another row's token until `propose` rewrites it."""
        embeds = self._embeds(params, target_params, jnp.roll(inp.token_ids, -1))
        fused = self._fuse(params, hidden)
        _, caches = self._head(params, embeds, fused, inp.positions, caches, inp.attn)
        return caches

    def propose(
        self,
        params: Any,
        target_params: Any,
        caches: list[KVCache],
        rows: ProposalInputs,
        features: jax.Array,
    ) -> tuple[jax.Array, jax.Array, list[KVCache]]:
        """As `Drafter.propose`; `features` are the step's hidden states at its logits
        rows, and a row's first step runs at the position before its newest token,
        whatever its limit; later steps feed the head's own output back."""

        def step(token, pos, attn, feature, caches):
            embeds = self._embeds(params, target_params, token)
            out, caches = self._head(params, embeds, feature, pos, caches, attn)
            return out, out, caches

        score = lambda h: self._score(params, target_params, h)
        first = self._fuse(params, features[rows.feature_rows])
        return draft_steps(self.k, self.block_size, rows, caches, step, score, first, True)


class Eagle3Drafter(EagleDrafter):
    """An EAGLE-3 head: as EAGLE-1, but its features are the target's aux hidden states
    `[T, 3H]` fused by the head's `fc`, and it scores with its own draft-vocabulary
    lm_head (mapped to target ids)."""

    @property
    def aux_layers(self) -> tuple[int, ...]:  # type: ignore[override]
        return self.model.module.aux_layers

    def _fuse(self, params: Any, hidden: jax.Array) -> jax.Array:
        return self._head(params, hidden, method="fuse")

    def _score(self, params: Any, target_params: Any, x: jax.Array) -> jax.Array:
        return self._head(params, x, method="logits")


class MTPDrafter(EagleDrafter):
    """DeepSeek-V3's MTP layer (`jvllm.models.deepseek_mtp`): as EAGLE-1, the one layer
    reused for every step; it scores with its `shared_head` (the target's lm_head where
    it has none)."""

    def _score(self, params: Any, target_params: Any, x: jax.Array) -> jax.Array:
        normed = self._head(params, x, method="head_norm")
        if self.model.module.own_head:
            return self._head(params, normed, method="logits")
        return super()._score(params, target_params, normed)


class MedusaDrafter(Drafter):
    """Medusa heads over the target's hidden state: k drafts from one feature per row."""

    uses_features = True

    def write_kv(
        self,
        params: Any,
        target_params: Any,
        caches: list[KVCache],
        inp: ModelInput,
        hidden: jax.Array,
    ) -> list[KVCache]:
        return caches  # the heads keep no K/V

    def propose(
        self,
        params: Any,
        target_params: Any,
        caches: list[KVCache],
        rows: ProposalInputs,
        features: jax.Array,
    ) -> tuple[jax.Array, jax.Array, list[KVCache]]:
        """Head i's argmax is draft i; q is one-hot at it (vLLM's top-1 Medusa)."""
        module = self.model.module
        logits = module.apply({"params": params}, features[rows.feature_rows])  # [S, heads, V]
        drafts = argmax_rows(logits[:, : self.k].reshape(-1, logits.shape[-1]))  # [S * k]
        q = jax.nn.one_hot(drafts, logits.shape[-1], dtype=jnp.float32)
        return drafts.reshape(-1, self.k).astype(jnp.int32), q, caches


def make_drafter(
    draft: LoadedModel | None, target: LoadedModel, k: int, block_size: int
) -> Drafter | None:
    """The proposer for `draft` (a draft model or a head, by its module), if any."""
    from jvllm.models.deepseek_mtp import DeepseekMTP
    from jvllm.models.eagle import EagleHead
    from jvllm.models.eagle3 import Eagle3Head
    from jvllm.models.medusa import MedusaHeads

    if draft is None:
        return None
    if getattr(target.spec.variant, "mrope_section", None):  # its rotary rows: [3, T]
        raise ValueError(
            f"{target.spec.architecture} (M-RoPE) takes n-gram speculation only, not a "
            "draft model or a speculator head"
        )
    heads = {Eagle3Head: Eagle3Drafter, EagleHead: EagleDrafter, DeepseekMTP: MTPDrafter}
    for kind, cls in heads.items():
        if isinstance(draft.module, kind):
            return cls(draft, target, k, block_size)
    if isinstance(draft.module, MedusaHeads):
        return MedusaDrafter(draft, k, block_size)
    return Drafter(draft, k, block_size)


def draft_steps(
    k: int,
    block_size: int,
    rows: ProposalInputs,
    caches: list[KVCache],
    step: StepFn,
    score: Callable[[jax.Array], jax.Array],
    carry: Any,
    first_always: bool,
) -> tuple[jax.Array, jax.Array, list[KVCache]]:
    """k unrolled single-token steps from `rows`; step i (at position + i) draws draft
    i + 1. Steps past a row's limit (but the first, with `first_always`) write into the
    null block and their tokens are ignored."""
    num_rows = rows.tokens.shape[0]
    greedy = rows.temperature < SAMPLING_EPS
    temperature = jnp.where(greedy, 1.0, rows.temperature)[:, None]
    qsl = jnp.arange(num_rows + 1, dtype=jnp.int32)
    limits = jnp.maximum(rows.limits, 1) if first_always else rows.limits
    token = rows.tokens
    drafts, dists = [], []
    for i in range(k):
        valid = i < limits
        # Past the limit, re-read the first position: finite values, nothing written
        # but the null block.
        pos = jnp.where(valid, rows.positions + i, rows.positions)
        blocks = jnp.take_along_axis(rows.tables, (pos // block_size)[:, None], axis=1)[:, 0]
        slots = jnp.where(valid, blocks * block_size + pos % block_size, 0)
        attn = AttentionMetadata(slots, qsl, pos + 1, rows.tables)
        hidden, carry, caches = step(token, pos, attn, carry, caches)
        logits = score(hidden).astype(jnp.float32)
        argmax = argmax_rows(logits)
        q = jax.nn.softmax(logits / temperature, axis=-1)
        q = jnp.where(greedy[:, None], jax.nn.one_hot(argmax, q.shape[-1]), q)
        token = jax.vmap(_draw)(rows.seeds, rows.steps + i, q).astype(jnp.int32)
        drafts.append(token)
        dists.append(q)
    q_rows = jnp.stack(dists, axis=1).reshape(num_rows * k, -1)
    return jnp.stack(drafts, axis=1), q_rows, caches


def _draw(seed: jax.Array, step: jax.Array, probs: jax.Array) -> jax.Array:
    """One row's draft token from `probs`, keyed by the request's seed and output index
    (a one-hot row gives its token whatever the draw)."""
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), step), _DRAFT_TAG)
    return inverse_cdf_draw(probs, key)
