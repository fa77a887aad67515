"""The bodies of the runner's jitted programs: the forward (one stage, or pipelined),
a draft proposal, the sampler with its padded token row, the grammar bitmask and
prompt logprobs.

Owns what each program computes on the device, as a pure function of its arguments and
of the fixed configuration held here (model, drafter, mesh, row bucket). Not owned:
compiling and storing them (`programs.Program`), choosing shapes, moving data to and
from the device, or when they run (`model_runner.ModelRunner`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jvllm.layers import sampler
from jvllm.layers.attention import KVCache
from jvllm.lora.punica import LoRAWeights, applying_lora
from jvllm.models.llama import stage_forward
from jvllm.models.loader import LoadedModel
from jvllm.parallel.mesh import pp_size, replicated
from jvllm.parallel.pipeline import run_pipeline
from jvllm.runner.drafter import Drafter, ProposalInputs
from jvllm.runner.input_batch import BatchShape, ModelInput, unpack, unpack_micro_batches
from jvllm.sampling_params import MAX_LOGPROBS

# On CPU devices prompt logprobs score the positions in groups of this many, only as
# many groups as the step has tokens: one program for every token bucket.
SCORE_GROUP_TOKENS_CPU = 64


def group_rows_on(platform: str) -> int | None:
    """The sampler's row groups on `platform` (`StepPrograms.group_rows`)."""
    return sampler.GROUP_ROWS_CPU if platform == "cpu" else None


def params_platform(params: Any) -> str:
    """The platform of the devices holding `params` (a compile-only runner's: its
    target's, not this machine's)."""
    return next(iter(jax.tree.leaves(params)[0].sharding.device_set)).platform


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity, as jit needs
class StepPrograms:
    model: LoadedModel
    drafter: Drafter | None
    mesh: Mesh | None
    # The largest logits-row bucket (on CPU rounded up to whole sampler groups): the
    # sampled-token row's length.
    max_rows: int
    # With `group_rows`: the hidden states' rows, the largest bucket's tokens rounded up
    # to whole `SCORE_GROUP_TOKENS_CPU` groups (0 otherwise).
    max_tokens: int
    # [Q, V]: a proposal's q rows, padded (None without a drafter).
    draft_probs_shape: tuple[int, int] | None
    # Offloaded weights (cpu_offload_gb): parameter path -> its device-memory sharding.
    bring_in_shardings: dict[str, Any]

    @property
    def pp(self) -> int:
        return pp_size(self.mesh)

    @property
    def platform(self) -> str:
        """Where the programs run: the weights' devices' platform."""
        return params_platform(self.model.params)

    @property
    def group_rows(self) -> int | None:
        """On CPU devices, `sampler.GROUP_ROWS_CPU`: the logits of every bucket are padded
        to `max_rows` (a multiple of it), so that one sampler program serves them all,
        taking only the groups of rows in use. Elsewhere None: one sampler program per
        logits-row bucket, all its rows at once."""
        return group_rows_on(self.platform)

    @property
    def num_target_layers(self) -> int:
        return self.model.spec.num_layers

    def forward(
        self,
        params: Any,
        caches: list[KVCache],
        packed: jax.Array,
        last_sampled: jax.Array,
        shape: BatchShape,
        draft_params: Any = None,
        logits_buffer: jax.Array | None = None,
        lora_weights: LoRAWeights | None = None,
        mm_inputs: tuple[jax.Array, jax.Array] | None = None,
        mrope_positions: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array, list[KVCache], jax.Array, jax.Array | None]:
        """Logits `[S, V]` (with `group_rows`: `[max_rows, V]` float32, written over
        `logits_buffer` when given, which the caller donates, else over zeros), the
        hidden states, the caches, the last input tokens and the features an EAGLE or Medusa
        head reads. `lora_weights`: the device's LoRA slots, each token's slot in `packed`.
        `mm_inputs`: image embeddings `[T, H]` and mask `[T]`, merged at the image tokens;
        `mrope_positions`: an M-RoPE model's `[3, T]` rotary positions."""
        params = self.bring_in(params)
        module = self.model.module
        split = self.num_target_layers
        if self.pp > 1:
            hidden, token_ids, logits_indices, target_caches = self.pipeline_forward(
                params, caches, packed, last_sampled, shape
            )
        else:
            inp = unpack(packed, shape, last_sampled)
            if mrope_positions is not None:  # rotary only: slots were computed on the host
                inp = dataclasses.replace(inp, positions=mrope_positions)
            adapters = contextlib.nullcontext()
            if lora_weights is not None:
                adapters = applying_lora(lora_weights, inp.lora_slots)
            with adapters:
                hidden, target_caches, feature_source = self.target_forward(
                    params, caches[:split], inp, mm_inputs
                )
            token_ids, logits_indices = inp.token_ids, inp.logits_indices
        draft_caches = caches[split:]
        if self.drafter is not None:
            draft_caches = self.drafter.write_kv(
                draft_params, params, draft_caches, inp, feature_source
            )
        last = hidden[logits_indices]  # [S, H]
        logits = module.apply({"params": params}, last, method=module.logits)  # [S, V]
        last_inputs = token_ids[logits_indices]  # [S]
        features = None
        if self.drafter is not None and self.drafter.uses_features:
            features = self._padded(feature_source[logits_indices], self.max_rows)
        if self.group_rows is not None:  # one sampler program for every bucket
            hidden = self._padded(hidden, self.max_tokens)  # and one prompt-logprob program
            last_inputs = self._padded(last_inputs, self.max_rows)
            logits = logits.astype(jnp.float32)
            if logits_buffer is None:
                logits = self._padded(logits, self.max_rows)
            else:  # in place: no [max_rows, V] array written afresh every step
                logits = jax.lax.dynamic_update_slice_in_dim(logits_buffer, logits, 0, 0)
                if self.mesh is not None:
                    logits = jax.lax.with_sharding_constraint(logits, replicated(self.mesh))
        return logits, hidden, [*target_caches, *draft_caches], last_inputs, features

    def target_forward(
        self,
        params: Any,
        caches: list[KVCache],
        inp: ModelInput,
        mm_inputs: tuple[jax.Array, jax.Array] | None = None,
    ) -> tuple[jax.Array, list[KVCache], jax.Array]:
        """The target's final hidden states `[T, H]`, its caches, and the features a
        proposer reads: the final hidden states, or for an EAGLE-3 head the inputs of its
        aux layers concatenated `[T, 3H]` (collected only then)."""
        module = self.model.module
        args = ({"params": params}, inp.token_ids, inp.positions, caches, inp.attn)
        args += tuple(mm_inputs) if mm_inputs is not None else ()
        layers = self.drafter.aux_layers if self.drafter is not None else ()
        if not layers:
            hidden, caches = module.apply(*args)
            return hidden, caches, hidden
        (hidden, caches), state = module.apply(*args, mutable=["intermediates"])
        sown = state.get("intermediates", {}).get("model", {})
        missing = [i for i in layers if f"aux_{i}" not in sown]
        if missing:
            raise ValueError(
                f"{self.model.spec.architecture} does not give the hidden states of "
                f"layers {missing} an EAGLE-3 head needs"
            )
        aux = jnp.concatenate([sown[f"aux_{i}"][0] for i in layers], axis=-1)
        return hidden, caches, aux

    def pipeline_forward(
        self,
        params: Any,
        caches: list[KVCache],
        packed: jax.Array,
        last_sampled: jax.Array,
        shape: BatchShape,
    ) -> tuple[jax.Array, jax.Array, jax.Array, list[KVCache]]:
        """The target's forward through the pipeline stages (`jvllm.parallel.pipeline`):
        final-norm hidden states `[T, H]` and input tokens `[T]` in row order, the logits
        indices, and the caches."""
        assert self.mesh is not None
        module = self.model.module
        inp, token_index, logits_indices = unpack_micro_batches(packed, shape, last_sampled)
        x = module.apply({"params": params}, inp.token_ids, method=module.embed)  # [M, Tm, H]
        per_stage = self.model.spec.num_layers // self.pp
        layers = [params["model"][f"layers_{j}"] for j in range(per_stage)]
        busy = inp.attn.query_start_loc[:, -1] > 0  # [M]: an empty micro-batch skips
        stage = functools.partial(stage_forward, module)
        out, caches = run_pipeline(
            stage, self.mesh, layers, caches, x, (inp.positions, inp.attn), busy
        )
        hidden = out.reshape(-1, out.shape[-1])[token_index]  # [T, H] in row order
        hidden = module.apply({"params": params}, hidden, method=module.final_norm)
        return hidden, inp.token_ids.reshape(-1)[token_index], logits_indices, caches

    def bring_in(self, params: Any) -> Any:
        """The offloaded layers' weights copied from host memory into the step (XLA
        schedules the copies); the rest as they are."""
        if not self.bring_in_shardings:
            return params

        def move(path: Any, leaf: jax.Array) -> jax.Array:
            target = self.bring_in_shardings.get(jax.tree_util.keystr(path))
            return leaf if target is None else jax.device_put(leaf, target)

        return jax.tree_util.tree_map_with_path(move, params)

    def propose(
        self,
        params: Any,
        target_params: Any,
        caches: list[KVCache],
        rows: ProposalInputs,
        features: jax.Array | None,
    ) -> tuple[jax.Array, jax.Array, list[KVCache]]:
        """The proposer's drafts (`Drafter.propose`), its q rows padded to [Q, V]."""
        assert self.drafter is not None and self.draft_probs_shape is not None
        split = self.num_target_layers
        drafts, q, draft_caches = self.drafter.propose(
            params, target_params, caches[split:], rows, features
        )
        padded = self._padded(q.astype(jnp.float32), self.draft_probs_shape[0])
        return drafts, padded, [*caches[:split], *draft_caches]

    def sample(
        self,
        logits: jax.Array,
        md: sampler.SamplingMetadata,
        last_input: jax.Array,
        draft_probs: jax.Array | None = None,
        bitmask: jax.Array | None = None,
    ) -> tuple[sampler.SamplerOutput, jax.Array]:
        """The sampled rows; `bitmask` (with `group_rows`: the apply_bitmask program's
        work, inside the groups) masks the logits first."""
        out = sampler.sample(logits, md, last_input, draft_probs, self.group_rows, bitmask)
        # Placed as the forward expects it (`_padded`): no second forward program.
        padded = self._padded(out.token_ids, self.max_rows)
        return out, padded  # padded [R]: the next step's placeholders read it

    def _padded(self, x: jax.Array, rows: int) -> jax.Array:
        """`x` with zero rows appended up to `rows` (a fixed shape across buckets, as
        the program reading it next expects), replicated over a mesh."""
        padded = jnp.zeros((rows, *x.shape[1:]), x.dtype).at[: x.shape[0]].set(x)
        if self.mesh is not None:
            padded = jax.lax.with_sharding_constraint(padded, replicated(self.mesh))
        return padded

    def apply_bitmask(self, logits: jax.Array, bitmask: jax.Array) -> jax.Array:
        # A method, as every program here: each runner's Programs count their own
        # compilations.
        return sampler.apply_token_bitmask(logits, bitmask)

    def all_logprobs(
        self, params: Any, hidden: jax.Array, targets: jax.Array
    ) -> tuple[jax.Array, ...]:
        """Every position's top-K logprobs and the logprob and rank of `targets` `[T]`
        (the next prompt token; any id >= 0 where unused, -1 past the step's tokens):
        only these leave the device. With `group_rows`, in groups of
        `SCORE_GROUP_TOKENS_CPU` positions, as many as hold the step's tokens; zeros
        past them."""
        if self.group_rows is None:
            return self._score_positions(params, hidden, targets)
        size = SCORE_GROUP_TOKENS_CPU

        def group(lo: jax.Array) -> tuple[jax.Array, ...]:
            part = lambda x: jax.lax.dynamic_slice_in_dim(x, lo, size)
            return self._score_positions(params, part(hidden), part(targets))

        shapes = jax.eval_shape(self._score_positions, params, hidden, targets)
        zeros = tuple(jnp.zeros(x.shape, x.dtype) for x in shapes)
        return sampler.over_groups(group, size, jnp.sum(targets >= 0), zeros)

    def _score_positions(
        self, params: Any, hidden: jax.Array, targets: jax.Array
    ) -> tuple[jax.Array, ...]:
        targets = jnp.maximum(targets, 0)
        module = self.model.module
        logits = module.apply({"params": params}, hidden, method=module.logits)
        logprobs = jax.nn.log_softmax(logits)  # [T, V]
        top_logprobs, top_ids = jax.lax.top_k(logprobs, min(MAX_LOGPROBS, logprobs.shape[-1]))
        target = jnp.take_along_axis(logprobs, targets[:, None], axis=-1)  # [T, 1]
        ranks = 1 + jnp.sum(logprobs > target, axis=-1, dtype=jnp.int32)  # [T]
        return top_ids.astype(jnp.int32), top_logprobs, target[:, 0], ranks
