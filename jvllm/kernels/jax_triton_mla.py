"""Paged MLA decode on NVIDIA GPUs: `triton_mla`'s kernel launched through jax-triton.

Owns `mla_decode`, the absorbed latent attention of one query per sequence inside a
jitted JAX step: `q_nope` folded into the latent space by `W_kb` (an XLA matmul), the
Triton kernel over the paged latent cache, the split partials merged, and the
softmax-weighted latents up-projected by `W_vb`. The same computation as the decode rows
of `mla_reference.mla_paged_attention`. jax-triton is imported inside the call (it
raises ImportError on a CPU-only jaxlib); `JVLLM_TRITON_COMPUTE_CAPABILITY` names the
target of a compile-only device (`jax_triton_attention.compute_capability`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jvllm.kernels.jax_triton_attention import compute_capability


def mla_decode(
    q_nope: jax.Array,  # [S, Hq, Dn]: sequence s's one query
    q_pe: jax.Array,  # [S, Hq, Dr], rotated
    latent_cache: jax.Array,  # [N, BS, 1, R]
    rope_cache: jax.Array,  # [N, BS, 1, Dr]
    w_kb: jax.Array,  # [Hq, Dn, R]
    w_vb: jax.Array,  # [Hq, Dv, R]
    block_tables: jax.Array,  # [S, W] int32
    seq_lens: jax.Array,  # [S] int32, the query included; 0: a padding row
    scale: float,
    *,
    num_splits: int | None = None,
    block_h: int | None = None,
    tile_n: int | None = None,
) -> jax.Array:  # [S, Hq, Dv]
    """Each sequence's one query (at position seq_len - 1) over its paged latents; the
    keyword-only knobs override the launch configuration."""
    import jax_triton as jt

    from jvllm.kernels import triton_attention as ta
    from jvllm.kernels import triton_mla as tm

    num_seqs, num_heads, _ = q_nope.shape
    rank, rope_dim = latent_cache.shape[-1], rope_cache.shape[-1]
    dtype = latent_cache.dtype
    q_lat = jnp.einsum("shd,hdr->shr", q_nope, w_kb.astype(q_nope.dtype)).astype(dtype)
    cfg = tm.mla_launch_config(
        num_seqs, num_heads, rank, rope_dim, jnp.dtype(dtype).itemsize, num_splits, block_h, tile_n
    )
    params = tm.mla_kernel_params(
        cfg,
        num_heads,
        rank,
        rope_dim,
        latent_cache.shape[1],
        block_tables.shape[1],
        scale,
        jnp.dtype(dtype).name,
    )
    split = cfg.num_splits > 1
    part_out, part_lse = tm.mla_partial_shapes(cfg, num_seqs, num_heads, rank)
    target = compute_capability()
    out, lse = jt.triton_call(
        q_lat,
        q_pe.astype(dtype),
        latent_cache,
        rope_cache,
        block_tables.astype(jnp.int32),
        seq_lens.astype(jnp.int32),
        kernel=tm.mla_decode_kernel,
        out_shape=(
            jax.ShapeDtypeStruct(part_out, jnp.float32) if split else q_lat,
            jax.ShapeDtypeStruct(part_lse if split else (1,), jnp.float32),
        ),
        grid=tm.mla_grid(cfg, num_seqs, num_heads),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        compute_capability=target,
        **params,
    )
    if split:
        out = jt.triton_call(
            out,
            lse,
            lse,  # the sinks operand, never read without sinks
            kernel=ta.merge_splits_kernel,
            out_shape=jax.ShapeDtypeStruct(q_lat.shape, dtype),
            grid=(num_seqs, num_heads),
            num_warps=cfg.num_warps,
            compute_capability=target,
            **ta.merge_params(tm.merge_config(cfg), q_lat.shape),
        )
    # The summed latents, up-projected once per head.
    v = jnp.einsum("shr,hvr->shv", out.astype(jnp.float32), w_vb.astype(jnp.float32))
    return v.astype(q_nope.dtype)
