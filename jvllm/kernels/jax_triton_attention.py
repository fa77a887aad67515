"""Paged attention on NVIDIA GPUs: the Triton kernels launched through jax-triton.

Owns the `jax_triton.triton_call` wrapper that puts `triton_attention`'s kernels inside
a jitted JAX step, with the same signature and contract as `reference.paged_attention`.
Not the kernels themselves (`triton_attention`) nor the choice of backend
(`jvllm.layers.attention`). jax-triton raises ImportError on a CPU-only jaxlib, so it
is imported inside the call, on the GPU path only.

jax-triton compiles each kernel for the compute capability it reads from the device. A
compile-only device (an XLA:GPU target description, no GPU) has none to give, so
`JVLLM_TRITON_COMPUTE_CAPABILITY` (e.g. "90" for an H100/H200) names it instead; unset,
the device decides. tests/gpu_compile sets it to build the step for an H200 on a CPU.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp


def compute_capability() -> int | None:
    """The override of the target's compute capability (major * 10 + minor), if set."""
    value = os.environ.get("JVLLM_TRITON_COMPUTE_CAPABILITY", "")
    if not value:
        return None
    if not value.isdigit():
        raise ValueError(f"JVLLM_TRITON_COMPUTE_CAPABILITY must be digits like 90, got {value!r}")
    return int(value)


def paged_attention(
    q: jax.Array,  # [T, Hq, D]
    k_cache: jax.Array,  # [N, BS, Hkv, D]
    v_cache: jax.Array,  # [N, BS, Hkv, D]
    block_tables: jax.Array,  # [S, W] int32
    seq_lens: jax.Array,  # [S] int32
    query_start_loc: jax.Array,  # [S + 1] int32
    scale: float,
    sliding_window: int | None = None,
    *,
    soft_cap: float | None = None,
    sinks: jax.Array | None = None,  # [Hq]
    num_splits: int | None = None,
    block_m: int | None = None,
    tile_n: int | None = None,
) -> jax.Array:  # [T, Hq, D]
    """`reference.paged_attention` on the GPU; the keyword-only knobs override the
    launch configuration (None picks the default for the shape)."""
    try:
        import jax_triton as jt
    except ImportError as e:
        raise ImportError(
            f"attention_backend='triton' needs jax-triton on a CUDA jaxlib "
            f"(pip install 'jvllm[gpu]'): {e}; use attention_backend='reference'"
        ) from e
    from jvllm.kernels import triton_attention as ta

    num_tokens, num_heads, head_dim = q.shape
    num_seqs = block_tables.shape[0]
    num_kv_heads = k_cache.shape[2]
    # The cache is the query's dtype, or fp8 (kv_cache_dtype), which the kernel casts up.
    fp8 = (jnp.float8_e4m3fn, jnp.float8_e5m2)
    assert k_cache.dtype == v_cache.dtype and (k_cache.dtype == q.dtype or k_cache.dtype in fp8), (
        q.dtype,
        k_cache.dtype,
        v_cache.dtype,
    )
    cfg = ta.launch_config(
        num_tokens,
        num_seqs,
        num_heads,
        num_kv_heads,
        head_dim,
        q.dtype.itemsize,
        num_splits=num_splits,
        block_m=block_m,
        tile_n=tile_n,
    )
    params = ta.kernel_params(
        cfg,
        q.shape,
        k_cache.shape,
        block_tables.shape,
        scale,
        sliding_window,
        jnp.dtype(q.dtype).name,
        soft_cap=soft_cap,
        has_sinks=sinks is not None,
    )
    metadata = [x.astype(jnp.int32) for x in (block_tables, seq_lens, query_start_loc)]
    # Without sinks the kernels never read the pointer; one fp32 stands in.
    sinks_arg = jnp.zeros((1,), jnp.float32) if sinks is None else sinks.astype(jnp.float32)
    split = cfg.num_splits > 1
    target = compute_capability()
    part_out, part_lse = ta.partial_shapes(cfg, q.shape)
    out_shapes = (
        jax.ShapeDtypeStruct(part_out if split else q.shape, jnp.float32 if split else q.dtype),
        jax.ShapeDtypeStruct(part_lse if split else (1,), jnp.float32),
    )
    out, lse = jt.triton_call(
        q,
        k_cache,
        v_cache,
        *metadata,
        sinks_arg,
        kernel=ta.paged_attention_kernel,
        out_shape=out_shapes,
        grid=ta.attention_grid(cfg, num_tokens, num_seqs, num_kv_heads),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        compute_capability=target,
        **params,
    )
    if not split:
        return out
    return jt.triton_call(
        out,
        lse,
        sinks_arg,
        kernel=ta.merge_splits_kernel,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid=ta.merge_grid(num_tokens, num_heads),
        num_warps=cfg.num_warps,
        compute_capability=target,
        **ta.merge_params(cfg, q.shape, has_sinks=sinks is not None),
    )
