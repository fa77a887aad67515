"""The experts' grouped matmul on NVIDIA GPUs: `triton_grouped_matmul`'s kernel launched
through jax-triton, with the padded layout it reads built in JAX.

`grouped_matmul(rows, w, sorted_experts, group_sizes)` has `jax.lax.ragged_dot`'s
contract for `layers/moe.py` (rows sorted by expert, `w` `[E, N, K]`), but reads only the
weights of experts with rows: XLA:GPU expands `ragged_dot` into dense dots over every
expert instead (docs/moe.md). Every shape is static: the padded buffer has room for
`ceil(P / BLOCK_M) + E` tiles whatever the routing. jax-triton is imported inside the
call (ImportError on a CPU jaxlib). Not owned: the kernel, the routing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jvllm.kernels import triton_grouped_matmul as tg
from jvllm.kernels.jax_triton_attention import compute_capability


def padded_layout(
    sorted_experts: jax.Array,  # [P] int32, ascending; E marks a pair of another device's
    group_sizes: jax.Array,  # [E] int32
    block_m: int = tg.BLOCK_M,
) -> tuple[jax.Array, jax.Array]:
    """Each sorted pair's row in the padded buffer (past its end for a pair of no local
    expert) `[P]`, and each row tile's expert or -1 `[ceil(P / block_m) + E]`."""
    num_experts, num_pairs = group_sizes.shape[0], sorted_experts.shape[0]
    num_tiles = -(-num_pairs // block_m) + num_experts
    padded = (group_sizes + block_m - 1) // block_m * block_m  # [E]
    padded_end = jnp.cumsum(padded)
    padded_start = padded_end - padded
    start = jnp.cumsum(group_sizes) - group_sizes
    safe = jnp.minimum(sorted_experts, num_experts - 1)
    rank = jnp.arange(num_pairs, dtype=jnp.int32) - start[safe]  # place within its group
    dest = jnp.where(sorted_experts < num_experts, padded_start[safe] + rank, num_tiles * block_m)
    tile_start = jnp.arange(num_tiles, dtype=jnp.int32) * block_m
    owner = jnp.searchsorted(padded_end, tile_start, side="right")  # first group ending later
    block_expert = jnp.where(owner < num_experts, owner, -1).astype(jnp.int32)
    return dest.astype(jnp.int32), block_expert


def grouped_matmul(
    rows: jax.Array,  # [P, K], sorted by expert
    w: jax.Array,  # [E, N, K]
    sorted_experts: jax.Array,  # [P] int32
    group_sizes: jax.Array,  # [E] int32
) -> jax.Array:  # [P, N]; rows of no local expert are 0
    import jax_triton as jt

    num_experts, n, k = w.shape
    dest, block_expert = padded_layout(sorted_experts, group_sizes)
    padded_rows = block_expert.shape[0] * tg.BLOCK_M
    x = jnp.zeros((padded_rows, k), rows.dtype).at[dest].set(rows, mode="drop")
    out = jt.triton_call(
        x,
        w.astype(rows.dtype),
        block_expert,
        kernel=tg.grouped_matmul_kernel,
        out_shape=jax.ShapeDtypeStruct((padded_rows, n), rows.dtype),
        grid=tg.grid(block_expert.shape[0], n),
        num_warps=4,
        num_stages=2,
        compute_capability=compute_capability(),
        N=n,
        K=k,
        BLOCK_M=tg.BLOCK_M,
        BLOCK_N=tg.BLOCK_N,
        BLOCK_K=tg.BLOCK_K,
        PRECISION=tg.precision(jnp.dtype(rows.dtype).name),
    )
    return out.at[dest].get(mode="fill", fill_value=0)
