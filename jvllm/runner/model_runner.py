"""ModelRunner: owns the parameters, the paged KV cache and the jitted step.

The only place that moves data between host and device. Per step: one packed
int32 buffer (and the sampling arrays) in, sampled tokens and logprobs out. The
KV cache is donated to every call, so it is updated in place. Every distinct
static shape compiles once; `num_compilations` counts them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jvllm.layers.attention import KVCache
from jvllm.models.loader import LoadedModel
from jvllm.runner.input_batch import (
    BatchShape,
    StepRow,
    pack_rows,
    pick_bucket,
    pow2_buckets,
    unpack,
)

MIN_TOKEN_BUCKET = 16
MIN_SEQ_BUCKET = 8


class ModelRunner:
    def __init__(
        self,
        loaded: LoadedModel,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
    ) -> None:
        self.model = loaded
        self.spec = loaded.spec
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.width = math.ceil(max_model_len / block_size)
        self.token_buckets = pow2_buckets(MIN_TOKEN_BUCKET, max_num_batched_tokens)
        self.seq_buckets = pow2_buckets(MIN_SEQ_BUCKET, max_num_seqs)
        self.num_compilations = 0
        self.caches = self._allocate_cache(num_blocks)
        self._forward_fn = jax.jit(
            self._forward_logits, static_argnames=("shape",), donate_argnames=("caches",)
        )
        self._all_logits_fn = jax.jit(self._all_logits)

    def _allocate_cache(self, num_blocks: int) -> list[KVCache]:
        s = self.spec
        shape = (num_blocks, self.block_size, s.num_kv_heads, s.head_dim)
        # Zeroed, not empty: masked slots must never hold NaN (0 * NaN = NaN).
        return [
            (jnp.zeros(shape, self.model.dtype), jnp.zeros(shape, self.model.dtype))
            for _ in range(s.num_layers)
        ]

    def batch_shape(self, rows: Sequence[StepRow]) -> BatchShape:
        num_tokens = sum(len(r.token_ids) for r in rows)
        return BatchShape(
            num_tokens=pick_bucket(num_tokens, self.token_buckets),
            num_seqs=pick_bucket(min(len(rows), self.seq_buckets[-1]), self.seq_buckets),
            width=self.width,
        )

    def _forward_logits(
        self, params: Any, caches: list[KVCache], packed: jax.Array, shape: BatchShape
    ) -> tuple[jax.Array, jax.Array, list[KVCache]]:
        self.num_compilations += 1  # runs only while tracing, i.e. once per compilation
        inp = unpack(packed, shape)
        module = self.model.module
        hidden, caches = module.apply(
            {"params": params}, inp.token_ids, inp.positions, caches, inp.attn
        )
        last = hidden[inp.logits_indices]  # [S, H]
        logits = module.apply({"params": params}, last, method=module.logits)
        return logits, hidden, caches

    def _all_logits(self, params: Any, hidden: jax.Array) -> jax.Array:  # [T, H] -> [T, V]
        self.num_compilations += 1
        module = self.model.module
        return module.apply({"params": params}, hidden, method=module.logits)

    def forward_logits(
        self, rows: Sequence[StepRow], every_token: bool = False
    ) -> list[np.ndarray]:
        """Runs one step; each row's logits: `[V]` of its last token, or `[n, V]` of
        all its n new tokens when `every_token` (tests and prompt scoring)."""
        shape = self.batch_shape(rows)
        packed = pack_rows(rows, shape, self.block_size)
        logits, hidden, self.caches = self._forward_fn(
            self.model.params, self.caches, jnp.asarray(packed), shape=shape
        )
        if not every_token:
            return list(np.asarray(logits)[: len(rows)])  # sync: the caller needs host values
        all_logits = np.asarray(self._all_logits_fn(self.model.params, hidden))
        bounds = np.cumsum([0] + [len(r.token_ids) for r in rows])
        return [all_logits[lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]
