"""PoolingRunner: the device side of a pooling model (vLLM's `runner="pooling"`).

Owns the pooling step program: the model over a step's rows (writing their K/V, so a
long prompt's later chunks attend to its earlier ones), its output rows (final-norm
hidden states; a classifier's score-head logits) and three reductions per row over
its new tokens: the first token's row, the rows' sum and the last token's row. Only
those `[3, S, D]` leave the device, once a step. Which reduction a request wants,
folding chunks together, normalising and activations are the engine's
(`engine/pooling_engine.py`). Everything else (parameters, the paged KV cache, buckets,
block copies and swaps) is `ModelRunner`'s, whose sampler this runner never compiles.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jvllm.engine.step_io import PooledRows, SchedulerOutput
from jvllm.layers.attention import KVCache
from jvllm.models.loader import LoadedModel
from jvllm.runner.input_batch import BatchShape, pack_rows, total_tokens, unpack
from jvllm.runner.model_runner import ModelRunner
from jvllm.runner.programs import Program
from jvllm.runner.start_up import SWAP_BUCKETS


def pool_step(
    model: LoadedModel,
    params: Any,
    caches: list[KVCache],
    packed: jax.Array,
    last_sampled: jax.Array,
    shape: BatchShape,
) -> tuple[jax.Array, list[KVCache]]:
    """`[3, S, D]` float32 (each row's first, summed and last output rows) and the
    updated caches. Padding tokens (past the rows' tokens) add nothing."""
    module = model.module
    inp = unpack(packed, shape, last_sampled)
    hidden, caches = module.apply(
        {"params": params}, inp.token_ids, inp.positions, caches, inp.attn
    )  # [T, H]
    if model.spec.num_labels:
        out = module.apply({"params": params}, hidden, method=module.logits)  # [T, L]
    else:
        out = hidden.astype(jnp.float32)  # [T, H]
    qsl = inp.attn.query_start_loc  # [S + 1]
    num_tokens, num_seqs = out.shape[0], shape.num_seqs
    token = jnp.arange(num_tokens)
    # Token t belongs to the last row starting at or before it (empty rows skipped).
    row = jnp.searchsorted(qsl, token, side="right") - 1  # [T]
    row = jnp.where(token < qsl[-1], row, num_seqs)  # padding: out of range, dropped
    total = jax.ops.segment_sum(out, row, num_segments=num_seqs)  # [S, D]
    first = out[jnp.minimum(qsl[:-1], num_tokens - 1)]  # [S, D]
    last = out[inp.logits_indices[:num_seqs]]  # [S, D]
    return jnp.stack([first, total, last]), caches


class PendingPooledRows:
    """A queued pooling step's `[3, S, D]` device array; `result()` is its one sync."""

    def __init__(self, rows: jax.Array, num_rows: int) -> None:
        self._rows = rows
        self._num_rows = num_rows

    def result(self) -> PooledRows:
        host = np.asarray(self._rows)[:, : self._num_rows]  # [3, n, D], waits for the step
        return PooledRows(host[0], host[1], host[2])


class PoolingRunner(ModelRunner):
    """`ModelRunner` with `pool()` in place of `forward()` then `sample()`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.pp > 1 or self.drafter is not None:
            raise ValueError("pooling models run without pipeline stages or speculative decoding")
        cpu = self.step_programs.platform == "cpu"
        self._pool_fn = Program(
            functools.partial(pool_step, self.model),
            "pool",
            None if cpu else self.executable_store,  # as the forward (ModelRunner)
            static_argnames=("shape",),
            donate_argnames=("caches",),
            fixed=(0, 1),
        )

    @property
    def num_compilations(self) -> int:
        return super().num_compilations + len(self._pool_fn.executables)

    def pool(self, scheduled: SchedulerOutput) -> PendingPooledRows:
        """Queues the step's rows; each row's table is read from the scheduler's array."""
        rows = scheduled.scheduled
        shape = self.batch_shape(total_tokens(rows))
        packed = pack_rows(rows, shape, self.block_size, scheduled.block_tables)
        self.token_slots[0] += total_tokens(rows)
        self.token_slots[1] += shape.num_tokens
        return PendingPooledRows(self._launch_pool(packed, shape), len(rows))

    def _launch_pool(self, packed: np.ndarray, shape: BatchShape) -> jax.Array:
        pooled, self.caches = self._pool_fn(
            self.model.params, self.caches, self._put(packed), self.last_sampled, shape=shape
        )
        return pooled

    def warm_up(self) -> None:
        """Compiles and runs the pooling program of every token bucket (no real rows:
        every token is padding and writes into the null block), a block copy and swaps."""
        for t in self.token_buckets:
            shape = self.batch_shape(t)
            jax.block_until_ready(self._launch_pool(pack_rows([], shape, self.block_size), shape))
        self.copy_blocks([(0, 0)])
        if self.host_caches:
            for size in SWAP_BUCKETS:
                self.swap_out([(0, 0)] * size)
                self.swap_in([(0, 0)] * size)
        jax.block_until_ready(self.caches)
