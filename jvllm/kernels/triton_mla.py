"""Paged multi-head latent attention decode (DeepSeek's MLA) as a Triton kernel.

Owns the `@triton.jit` kernel of the absorbed decode of `mla_reference` (one query per
sequence), its launch configuration, and `launch` through Triton's own launcher (torch
CUDA tensors, or CPU tensors under `TRITON_INTERPRET=1`). `jax_triton_mla` launches it
inside a jitted JAX step. Not owned: the absorption of `q_nope` into the latent space
and the up-projection of the result by `W_vb` (plain matmuls, left to XLA), prefill rows
(`mla_reference`'s expanded form), and the merge of split partials
(`triton_attention.merge_splits_kernel`, reused with head_dim = kv_lora_rank).

Design. The cache holds one shared head per token: the latent `c` `[R]` and the rope key
`k_pe` `[Dr]` (V3: R = 512, Dr = 64). For decode every query head attends to the same
keys, so one program takes BLOCK_H query heads of one sequence as the rows of its tiles
(M of the mma), reads each latent tile once for all of them, scores it as
`q_lat . c + q_pe . k_pe` and accumulates `p @ c`: the latents serve as both keys and
values, and the output is the softmax-weighted latent `[BLOCK_H, R]`. Long contexts over
few sequences split the key range over NUM_SPLITS programs, each writing a partial
output and its log-sum-exp for the merge kernel.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import triton
import triton.language as tl

from jvllm.kernels.triton_attention import (
    _LOG2E,
    MAX_SPLITS,
    SPLIT_SCRATCH_BYTES,
    TARGET_PROGRAMS,
    _dot,
    _next_pow2,
    _online_softmax,
)


class MLALaunchConfig(NamedTuple):
    block_h: int  # query heads per program (the mma's M)
    tile_n: int  # keys per inner-loop step
    num_splits: int  # programs sharing one sequence's key range
    num_warps: int
    num_stages: int


def mla_launch_config(
    num_seqs: int,
    num_heads: int,
    rank: int,
    rope_dim: int,
    itemsize: int,
    num_splits: int | None = None,
    block_h: int | None = None,
    tile_n: int | None = None,
) -> MLALaunchConfig:
    """Tile sizes and split count for one decode launch; None picks the default."""
    for name, dim in (("kv_lora_rank", rank), ("qk_rope_head_dim", rope_dim)):
        if dim < 16 or dim & (dim - 1):
            raise ValueError(
                f"the Triton MLA kernel needs a power-of-two {name} >= 16, got {dim}; "
                "use attention_backend='reference'"
            )
    # 16 rows fill one mma tile; more heads per program reuse each latent tile further
    # but keep a [BLOCK_H, R] fp32 accumulator: 16 x 512 is 64 registers a thread at 4 warps.
    block_h = max(_next_pow2(block_h or 16), 16)
    tile_n = max(_next_pow2(tile_n or (32 if itemsize <= 2 else 16)), 16)
    programs = num_seqs * math.ceil(num_heads / block_h)
    if num_splits is None:
        wanted = math.ceil(TARGET_PROGRAMS / programs)
        affordable = SPLIT_SCRATCH_BYTES // max(1, num_seqs * num_heads * rank * 4)
        num_splits = max(1, min(_next_pow2(wanted), MAX_SPLITS, affordable))
    return MLALaunchConfig(block_h, tile_n, num_splits, num_warps=4, num_stages=2)


def mla_grid(cfg: MLALaunchConfig, num_seqs: int, num_heads: int) -> tuple[int, int, int]:
    """(sequences, head blocks, splits)."""
    return (num_seqs, math.ceil(num_heads / cfg.block_h), cfg.num_splits)


def mla_kernel_params(
    cfg: MLALaunchConfig,
    num_heads: int,
    rank: int,
    rope_dim: int,
    block_size: int,
    max_blocks: int,
    scale: float,
    dtype_name: str,
    interpret: bool = False,
) -> dict[str, Any]:
    """The kernel's constexpr arguments."""
    return dict(
        SCALE=float(scale),
        NUM_HEADS=num_heads,
        RANK=rank,
        ROPE_DIM=rope_dim,
        BLOCK_SIZE=block_size,
        MAX_BLOCKS=max_blocks,
        BLOCK_H=cfg.block_h,
        TILE_N=cfg.tile_n,
        NUM_SPLITS=cfg.num_splits,
        # Triton's default for an fp32 dot is tf32 (10-bit mantissa): keep fp32 exact.
        DOT_PRECISION="ieee" if dtype_name == "float32" else "tf32",
        UPCAST_DOT=interpret and dtype_name == "bfloat16",
    )


def mla_partial_shapes(
    cfg: MLALaunchConfig, num_seqs: int, num_heads: int, rank: int
) -> tuple[tuple[int, int, int, int], tuple[int, int, int]]:
    """Shapes of the fp32 partial output and log-sum-exp a split launch writes."""
    return (cfg.num_splits, num_seqs, num_heads, rank), (cfg.num_splits, num_seqs, num_heads)


@triton.jit
def mla_decode_kernel(
    q_lat_ptr,  # [S, H, R]: q_nope folded into the latent space, unscaled
    q_pe_ptr,  # [S, H, Dr]: rotated
    latent_ptr,  # [N, BS, 1, R]
    rope_ptr,  # [N, BS, 1, Dr]
    block_tables_ptr,  # [S, W] int32
    seq_lens_ptr,  # [S] int32; 0: a padding row (its output is written as zeros)
    out_ptr,  # NUM_SPLITS == 1: [S, H, R] like q_lat; else fp32 [NUM_SPLITS, S, H, R]
    lse_ptr,  # fp32 [NUM_SPLITS, S, H] base-2 log-sum-exp; unused when NUM_SPLITS == 1
    SCALE: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    RANK: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    MAX_BLOCKS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    seq = tl.program_id(0)
    split = tl.program_id(2)
    num_seqs = tl.num_programs(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < NUM_HEADS
    ranks = tl.arange(0, RANK)
    ropes = tl.arange(0, ROPE_DIM)
    row = seq * NUM_HEADS + heads  # [BLOCK_H]
    h_ok = head_ok[:, None]
    q_lat = tl.load(q_lat_ptr + row[:, None] * RANK + ranks[None, :], mask=h_ok, other=0.0)
    q_pe = tl.load(q_pe_ptr + row[:, None] * ROPE_DIM + ropes[None, :], mask=h_ok, other=0.0)

    # The query (position seq_len - 1) sees every key of its sequence.
    seq_len = tl.load(seq_lens_ptr + seq)
    num_tiles = tl.cdiv(seq_len, TILE_N)
    per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    lo = split * per_split
    hi = tl.minimum(lo + per_split, num_tiles)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)  # running max, base-2 units
    denom = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, RANK], tl.float32)
    for j in range(lo, hi):
        pos = j * TILE_N + tl.arange(0, TILE_N)
        in_seq = pos < seq_len
        table = block_tables_ptr + seq * MAX_BLOCKS + pos // BLOCK_SIZE
        block = tl.load(table, mask=in_seq, other=0)
        # int64: a cache can pass 2**31 elements.
        slot = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
        # other=0: slots past the sequence may hold anything (NaN * 0 = NaN).
        lat = tl.load(
            latent_ptr + slot[:, None] * RANK + ranks[None, :], mask=in_seq[:, None], other=0.0
        ).to(q_lat.dtype)  # [TILE_N, R]
        k_pe = tl.load(
            rope_ptr + slot[:, None] * ROPE_DIM + ropes[None, :], mask=in_seq[:, None], other=0.0
        ).to(q_pe.dtype)  # [TILE_N, Dr]
        scores = _dot(q_lat, tl.trans(lat), DOT_PRECISION, UPCAST_DOT)
        scores += _dot(q_pe, tl.trans(k_pe), DOT_PRECISION, UPCAST_DOT)
        scores = tl.where(in_seq[None, :], scores * (SCALE * _LOG2E), float("-inf"))
        m, denom, acc = _online_softmax(scores, lat, m, denom, acc, DOT_PRECISION, UPCAST_DOT)

    out = acc / tl.where(denom > 0, denom, 1.0)[:, None]  # no key seen (padding): 0
    if NUM_SPLITS == 1:
        offs = row[:, None] * RANK + ranks[None, :]
        tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None])
    else:
        part = (split * num_seqs + seq) * NUM_HEADS + heads
        tl.store(out_ptr + part[:, None] * RANK + ranks[None, :], out, mask=head_ok[:, None])
        lse = tl.where(denom > 0, m + tl.log2(tl.where(denom > 0, denom, 1.0)), float("-inf"))
        tl.store(lse_ptr + part, lse, mask=head_ok)


def launch(
    q_lat: Any,
    q_pe: Any,
    latent_cache: Any,
    rope_cache: Any,
    block_tables: Any,
    seq_lens: Any,
    out: Any,
    part_out: Any,
    part_lse: Any,
    cfg: MLALaunchConfig,
    scale: float,
) -> None:
    """Runs the kernels through Triton's own launcher (torch tensors, CUDA or interpreted).

    The caller allocates `out` like q_lat and, for a split launch, the fp32 partials of
    `mla_partial_shapes` (any one-element fp32 tensor otherwise)."""
    from jvllm.kernels.triton_attention import merge_params, merge_splits_kernel

    num_seqs, num_heads, rank = q_lat.shape
    tensors = (q_lat, q_pe, latent_cache, rope_cache, block_tables, seq_lens, out)
    assert all(t.is_contiguous() for t in tensors), "the kernel indexes row-major tensors"
    params = mla_kernel_params(
        cfg,
        num_heads,
        rank,
        q_pe.shape[2],
        latent_cache.shape[1],
        block_tables.shape[1],
        scale,
        str(q_lat.dtype).removeprefix("torch."),
        interpret=not isinstance(mla_decode_kernel, triton.runtime.JITFunction),
    )
    split = cfg.num_splits > 1
    mla_decode_kernel[mla_grid(cfg, num_seqs, num_heads)](
        q_lat,
        q_pe,
        latent_cache,
        rope_cache,
        block_tables,
        seq_lens,
        part_out if split else out,
        part_lse,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **params,
    )
    if split:
        merge = merge_params(merge_config(cfg), (num_seqs, num_heads, rank))
        merge_splits_kernel[(num_seqs, num_heads)](
            part_out, part_lse, part_lse, out, num_warps=cfg.num_warps, **merge
        )


def merge_config(cfg: MLALaunchConfig) -> Any:
    """The attention kernel's launch config as `merge_params` reads it (its splits)."""
    from jvllm.kernels.triton_attention import LaunchConfig

    return LaunchConfig(16, 16, 16, cfg.num_splits, cfg.num_warps, cfg.num_stages)
