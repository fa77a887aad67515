"""Attention over the paged KV cache: metadata pytree and backend dispatch.

Owns `AttentionMetadata` (the per-step arrays every layer shares) and the choice
between the reference jax.numpy attention ("reference"), the Triton kernels
launched through jax-triton ("triton", NVIDIA GPUs only) and the C++ decode kernel
for XLA:CPU ("cpu"). Backends receive one layer's cache and return it updated with
this step's K/V. Every backend takes the same per-layer options: a sliding window,
a logit soft cap and per-head attention sinks (see `jvllm.kernels.reference`);
docs/attention_variants.md lists them.
"""

from __future__ import annotations

import dataclasses

import jax

from jvllm.kernels import reference


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: jax.Array  # [T] int32; padding tokens write into null block 0
    query_start_loc: jax.Array  # [S + 1] int32
    seq_lens: jax.Array  # [S] int32; 0 for padding rows
    block_tables: jax.Array  # [S, W] int32; unused entries 0


KVCache = tuple[jax.Array, jax.Array]  # K and V, each [num_blocks, block_size, Hkv, D]


def paged_attention(
    backend: str,
    q: jax.Array,  # [T, Hq, D]
    k: jax.Array,  # [T, Hkv, D]
    v: jax.Array,  # [T, Hkv, D]
    cache: KVCache,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    *,
    soft_cap: float | None = None,
    sinks: jax.Array | None = None,  # [Hq] float32
) -> tuple[jax.Array, KVCache]:
    """Writes this step's K/V into the cache, then attends through the block tables.

    scale is the softmax scale (a model's `query_pre_attn_scalar ** -0.5` included);
    sliding_window (None: none) is this layer's; soft_cap (None: none) caps each logit
    at `cap * tanh(logit / cap)` before masking; sinks adds one logit per query head to
    the softmax's denominator."""
    if soft_cap is not None and soft_cap <= 0:
        raise ValueError(f"soft_cap must be > 0 or None, got {soft_cap}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    if sinks is not None and sinks.shape != (q.shape[1],):
        raise ValueError(
            f"sinks must have shape ({q.shape[1]},), one per query head, got {sinks.shape}"
        )
    if backend == "reference":
        attend = reference.paged_attention
    elif backend == "triton":
        # Imported here: it needs Triton, which a CPU install may lack.
        from jvllm.kernels import jax_triton_attention

        attend = jax_triton_attention.paged_attention
    elif backend == "cpu":
        from jvllm.kernels import cpu_attention

        attend = cpu_attention.paged_attention
    else:
        raise ValueError(
            f"attention backend must be 'reference', 'triton' or 'cpu', got {backend!r}"
        )
    k_cache, v_cache = reference.write_kv(cache[0], cache[1], k, v, meta.slot_mapping)
    out = attend(
        q,
        k_cache,
        v_cache,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        scale,
        sliding_window,
        soft_cap=soft_cap,
        sinks=sinks,
    )
    return out, (k_cache, v_cache)
