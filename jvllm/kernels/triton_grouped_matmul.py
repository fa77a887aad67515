"""The experts' grouped matmul as a Triton kernel: each tile of rows belongs to one
expert and multiplies by that expert's weights alone.

Contract. `x [Mp, K]` holds the token-expert pairs sorted by expert, each expert's group
padded to a multiple of BLOCK_M rows (the padding rows are zeros); `block_expert [Mp /
BLOCK_M]` names the expert of each row tile, or -1 for a tile past every group. `w [E, N,
K]` is the checkpoint's `[out, in]` stack. `out [Mp, N] = x @ w[block_expert[tile]].T`
per tile; a -1 tile is written with zeros and reads no weight, so a step reads exactly
the weights of the experts its pairs route to (vLLM's fused-MoE layout). Building the
layout (`padded_layout`) and the launch are `jax_triton_grouped_matmul`'s. Every
dimension of `tl.dot` is >= 16 on the GPU: BLOCK_M, BLOCK_N, BLOCK_K are.
"""

from __future__ import annotations

import triton
import triton.language as tl

BLOCK_M = 16  # rows per tile: the group padding, and tl.dot's smallest M on the GPU
BLOCK_N = 64
BLOCK_K = 64


@triton.jit
def grouped_matmul_kernel(
    x_ptr,  # [Mp, K]
    w_ptr,  # [E, N, K]
    block_expert_ptr,  # [Mp / BLOCK_M] int32
    out_ptr,  # [Mp, N]
    N: tl.constexpr,
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,  # "ieee" for float32 (no TF32 rounding), "tf32" otherwise
):
    tile = tl.program_id(0)
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    expert = tl.load(block_expert_ptr + tile)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if expert >= 0:
        w_tile = w_ptr + expert.to(tl.int64) * N * K
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)  # [BK]
            a = tl.load(x_ptr + rows[:, None] * K + ks[None, :], mask=ks[None, :] < K, other=0.0)
            w_mask = (cols[:, None] < N) & (ks[None, :] < K)
            b = tl.load(w_tile + cols[:, None] * K + ks[None, :], mask=w_mask, other=0.0)
            acc += tl.dot(a, tl.trans(b), input_precision=PRECISION)  # [BM, BK] @ [BK, BN]
    out = out_ptr + rows[:, None] * N + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=cols[None, :] < N)


def grid(num_tiles: int, n: int) -> tuple[int, int]:
    return (num_tiles, triton.cdiv(n, BLOCK_N))


def precision(dtype_name: str) -> str:
    """tl.dot's input precision: float32 keeps full precision, as XLA's dots do."""
    return "ieee" if dtype_name == "float32" else "tf32"
