"""Paged attention as Triton kernels, plus the host-side launch configuration.

Owns the `@triton.jit` kernels for the ragged mixed batch of `reference.paged_attention`
(same arguments, same contract) and the pure-Python helpers that size their grids.
It does not own a framework: `jax_triton_attention` launches these kernels inside a
jitted JAX step on a GPU, and `launch` runs them on anything Triton's own launcher takes
(torch CUDA tensors, or torch CPU tensors under `TRITON_INTERPRET=1`).

Design. One program handles one query tile of one sequence, one KV head and one slice
("split") of that tile's key range. Its rows are (query token, query head of the KV
head's group) pairs, so each K/V tile is read once for the whole GQA group. A sequence's
tiles come right after those of the sequences before it, and the number of key tiles a
program walks comes from that sequence's own length: work follows each sequence's length,
never the batch maximum. With several splits (decode of long contexts over few
sequences), each split writes a partial result and its log-sum-exp, and a second kernel
merges them. The padding tail of the token axis (past `query_start_loc[-1]`) is treated
as one more sequence with no keys, so its output is written as zeros.

Variants (constexpr, so a plain launch compiles to the same program as before):
SOFT_CAP > 0 caps each scaled logit at `cap * tanh(logit / cap)` (Gemma 2); HAS_SINKS
adds each query head's sink logit to the softmax denominator (gpt-oss), in the attention
kernel when there is one split, else once in the merge.

GPU-only constraints the interpreter does not check, encoded here:
- `tl.dot` on 16-bit inputs needs a reduction dimension >= 16 (the GPU build rejects
  less; Triton 3.6+ pads small M and N itself, older releases needed them >= 16 too):
  TILE_N (keys per tile, P @ V's reduction) and head_dim (Q @ K^T's) are >= 16, and
  BLOCK_M (query rows) is kept >= 16, the height of one mma tile. head_dim must also be
  a power of two (`tl.arange` needs 2^k). tests/kernels builds the kernels for sm_90.
- Shared memory holds `num_stages` K and V tiles of TILE_N x head_dim (228 KiB per SM
  on Hopper): fp32 caches double each tile, so they get 2 stages instead of 3.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import triton
import triton.language as tl

# Programs a launch should offer before splitting the key range pays: a few per SM
# on a 132-SM H200, so that a partial wave at the end costs little.
TARGET_PROGRAMS = 1024
MAX_SPLITS = 16
# Bound on the fp32 partial outputs of a split launch.
SPLIT_SCRATCH_BYTES = 256 << 20
# exp(x) = exp2(x * log2(e)): exp2 is the cheaper instruction.
_LOG2E = tl.constexpr(1.4426950408889634)


class LaunchConfig(NamedTuple):
    block_m: int  # query rows per program: block_q tokens x the GQA group, padded
    block_q: int  # query tokens per program
    tile_n: int  # keys per inner-loop step
    num_splits: int  # programs sharing one query tile's key range
    num_warps: int
    num_stages: int


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def launch_config(
    num_tokens: int,
    num_seqs: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    itemsize: int,
    num_splits: int | None = None,
    block_m: int | None = None,
    tile_n: int | None = None,
) -> LaunchConfig:
    """Tile sizes and split count for one launch; None picks the default for the shape."""
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if head_dim < 16 or head_dim > 256 or head_dim & (head_dim - 1):
        raise ValueError(
            f"the Triton attention kernel needs a power-of-two head_dim in [16, 256], got "
            f"{head_dim}; use attention_backend='reference'"
        )
    group = num_heads // num_kv_heads
    decode_like = num_tokens <= 2 * num_seqs
    # 16 rows fill one mma tile; prefill reuses each K/V tile over more query rows.
    # Both tile sizes are powers of two: `tl.arange` needs that.
    block_m = max(_next_pow2(block_m or (16 if decode_like else 64)), 16, _next_pow2(group))
    block_q = block_m // group
    tile_n = max(_next_pow2(tile_n or (64 if itemsize <= 2 else 32)), 16)
    tiles = math.ceil(num_tokens / block_q) + num_seqs
    if num_splits is None:
        wanted = math.ceil(TARGET_PROGRAMS / (tiles * num_kv_heads))
        affordable = SPLIT_SCRATCH_BYTES // (num_tokens * num_heads * head_dim * 4)
        num_splits = max(1, min(_next_pow2(wanted), MAX_SPLITS, affordable))
    num_stages = 3 if itemsize <= 2 else 2
    # A 256-wide head (Gemma) keeps a [BLOCK_M, 256] fp32 accumulator: 4 warps spill it.
    num_warps = 8 if head_dim >= 256 else 4
    return LaunchConfig(block_m, block_q, tile_n, num_splits, num_warps, num_stages)


def attention_grid(
    cfg: LaunchConfig, num_tokens: int, num_seqs: int, num_kv_heads: int
) -> tuple[int, int, int]:
    """(query tiles, KV heads, splits). Sequence s owns tiles from
    `query_start_loc[s] // block_q + s`, which leaves room for its `cdiv(q_len, block_q)`
    tiles; the tail past the last sequence holds the padding tokens."""
    tiles = math.ceil(num_tokens / cfg.block_q) + num_seqs
    return (tiles, num_kv_heads, cfg.num_splits)


def merge_grid(num_tokens: int, num_heads: int) -> tuple[int, int]:
    return (num_tokens, num_heads)


def kernel_params(
    cfg: LaunchConfig,
    q_shape: tuple[int, int, int],  # [T, Hq, D]
    cache_shape: tuple[int, int, int, int],  # [N, BS, Hkv, D]
    block_tables_shape: tuple[int, int],  # [S, W]
    scale: float,
    sliding_window: int | None,
    dtype_name: str,
    interpret: bool = False,
    soft_cap: float | None = None,
    has_sinks: bool = False,
) -> dict[str, Any]:
    """The attention kernel's constexpr arguments (shapes are static under jit anyway)."""
    num_tokens, num_heads, head_dim = q_shape
    _, block_size, num_kv_heads, _ = cache_shape
    num_seqs, max_blocks = block_tables_shape
    return dict(
        SCALE=float(scale),
        SOFT_CAP=float(soft_cap or 0.0),
        HAS_SINKS=bool(has_sinks),
        SLIDING_WINDOW=int(sliding_window or 0),
        NUM_TOKENS=num_tokens,
        NUM_SEQS=num_seqs,
        SEQS_PAD=_next_pow2(num_seqs + 1),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        MAX_BLOCKS=max_blocks,
        BLOCK_M=cfg.block_m,
        BLOCK_Q=cfg.block_q,
        TILE_N=cfg.tile_n,
        NUM_SPLITS=cfg.num_splits,
        # Triton's default for an fp32 dot is tf32 (10-bit mantissa): keep fp32 exact.
        DOT_PRECISION="ieee" if dtype_name == "float32" else "tf32",
        UPCAST_DOT=interpret and dtype_name == "bfloat16",
    )


def merge_params(
    cfg: LaunchConfig, q_shape: tuple[int, int, int], has_sinks: bool = False
) -> dict[str, Any]:
    num_tokens, num_heads, head_dim = q_shape
    return dict(
        HAS_SINKS=bool(has_sinks),
        NUM_TOKENS=num_tokens,
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        NUM_SPLITS=cfg.num_splits,
        SPLITS_PAD=_next_pow2(cfg.num_splits),
    )


def partial_shapes(
    cfg: LaunchConfig, q_shape: tuple[int, int, int]
) -> tuple[tuple[int, int, int, int], tuple[int, int, int]]:
    """Shapes of the fp32 partial output and log-sum-exp a split launch writes."""
    lse_shape = (cfg.num_splits, *q_shape[:2])
    return (*lse_shape, q_shape[2]), lse_shape


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b accumulated in fp32. UPCAST is for Triton's interpreter only: it keeps
    bfloat16 as raw uint16 bits and multiplies those, so there the same (already
    rounded) values are multiplied in fp32, which is what the tensor cores compute."""
    if UPCAST:
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        c = tl.dot(a, b, input_precision=PRECISION)
    return c


@triton.jit
def _locate_tile(
    query_start_loc_ptr,
    seq_lens_ptr,
    tile,
    NUM_TOKENS: tl.constexpr,
    NUM_SEQS: tl.constexpr,
    SEQS_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
):
    """Sequence of grid tile `tile` and that tile's place in it; seq == NUM_SEQS is the
    padding tail, which has no keys."""
    seqs = tl.arange(0, SEQS_PAD)
    starts = tl.load(query_start_loc_ptr + seqs, mask=seqs <= NUM_SEQS, other=0)
    first_tiles = starts // BLOCK_Q + seqs  # strictly increasing over real entries
    owned = (first_tiles <= tile) & (seqs <= NUM_SEQS)
    seq = tl.sum(owned.to(tl.int32), axis=0) - 1
    q_start = tl.load(query_start_loc_ptr + seq)
    q_end = tl.load(query_start_loc_ptr + seq + 1, mask=seq < NUM_SEQS, other=NUM_TOKENS)
    seq_len = tl.load(seq_lens_ptr + seq, mask=seq < NUM_SEQS, other=0)
    q_tile = tile - (q_start // BLOCK_Q + seq)
    return seq, q_start, q_end - q_start, seq_len, q_tile


@triton.jit
def _key_tiles(
    seq_len,
    q_len,
    q_tile,
    split,
    SLIDING_WINDOW: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    """Key tiles [lo, hi) this program walks, and the end of the keys its queries see.

    The query tile needs keys up to its last query's position, from its first query's
    window start; `split` takes its share of those tiles. Positions of the padding tail
    are negative, so its end is clamped to 0 (no tiles)."""
    last_pos = seq_len - q_len + tl.minimum(q_len, (q_tile + 1) * BLOCK_Q) - 1
    kv_end = tl.maximum(last_pos + 1, 0)
    kv_begin = 0
    if SLIDING_WINDOW > 0:
        kv_begin = tl.maximum(seq_len - q_len + q_tile * BLOCK_Q - SLIDING_WINDOW + 1, 0)
    first = kv_begin // TILE_N
    num_tiles = tl.cdiv(kv_end, TILE_N) - first
    per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    lo = first + split * per_split
    return lo, tl.minimum(lo + per_split, first + num_tiles), kv_end


@triton.jit
def _soft_cap(x, CAP: tl.constexpr):
    """CAP * tanh(x / CAP), with tanh(t) = 1 - 2 / (exp(2t) + 1) (exact at both ends:
    exp2 overflows to inf or underflows to 0)."""
    e = tl.exp2(x * (2.0 * _LOG2E / CAP))
    return CAP * (1.0 - 2.0 / (e + 1.0))


@triton.jit
def _online_softmax(
    scores, v, m, denom, acc, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr
):
    """Folds one key tile into the running max m, denominator and unnormalised output.

    scores [BLOCK_M, TILE_N] are in base-2 units with -inf where a key is not visible."""
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    # A row with nothing visible yet keeps m = -inf; shift it by 0 so that exp2 gives 0.
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(scores - shift[:, None])
    alpha = tl.exp2(m - shift)
    denom = denom * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION, UPCAST_DOT)
    return m_new, denom, acc


@triton.jit
def paged_attention_kernel(
    q_ptr,  # [T, Hq, D]
    k_cache_ptr,  # [N, BS, Hkv, D]
    v_cache_ptr,  # [N, BS, Hkv, D]
    block_tables_ptr,  # [S, W] int32
    seq_lens_ptr,  # [S] int32
    query_start_loc_ptr,  # [S + 1] int32
    sinks_ptr,  # fp32 [Hq] sink logits; unused unless HAS_SINKS
    out_ptr,  # NUM_SPLITS == 1: [T, Hq, D] like q; else fp32 [NUM_SPLITS, T, Hq, D]
    lse_ptr,  # fp32 [NUM_SPLITS, T, Hq] base-2 log-sum-exp; unused when NUM_SPLITS == 1
    SCALE: tl.constexpr,
    SOFT_CAP: tl.constexpr,  # 0: none
    HAS_SINKS: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,  # 0: none
    NUM_TOKENS: tl.constexpr,
    NUM_SEQS: tl.constexpr,
    SEQS_PAD: tl.constexpr,  # power of two > NUM_SEQS
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    MAX_BLOCKS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    GROUP: tl.constexpr = NUM_HEADS // NUM_KV_HEADS
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq, q_start, q_len, seq_len, q_tile = _locate_tile(
        query_start_loc_ptr, seq_lens_ptr, tl.program_id(0), NUM_TOKENS, NUM_SEQS, SEQS_PAD, BLOCK_Q
    )
    if q_tile * BLOCK_Q >= q_len:
        return  # a spare tile: its sequence has fewer queries than the room left for it

    rows = tl.arange(0, BLOCK_M)
    q_local = q_tile * BLOCK_Q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_valid = (rows // GROUP < BLOCK_Q) & (q_local < q_len)
    q_pos = seq_len - q_len + q_local  # absolute position of each row's query
    dims = tl.arange(0, HEAD_DIM)
    q_offs = ((q_start + q_local) * NUM_HEADS + head)[:, None] * HEAD_DIM + dims[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_valid[:, None], other=0.0)  # [BLOCK_M, D]

    lo, hi, kv_end = _key_tiles(
        seq_len, q_len, q_tile, split, SLIDING_WINDOW, BLOCK_Q, TILE_N, NUM_SPLITS
    )
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max, base-2 units
    denom = tl.zeros([BLOCK_M], tl.float32)
    if HAS_SINKS and NUM_SPLITS == 1:  # the sink starts the max, with weight exp2(0) = 1
        m = tl.load(sinks_ptr + head, mask=row_valid, other=0.0).to(tl.float32) * _LOG2E
        denom = tl.full([BLOCK_M], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for j in range(lo, hi):
        kv_pos = j * TILE_N + tl.arange(0, TILE_N)
        in_seq = kv_pos < kv_end
        table = block_tables_ptr + seq * MAX_BLOCKS + kv_pos // BLOCK_SIZE
        block = tl.load(table, mask=in_seq, other=0)
        # int64: one layer's cache can pass 2**31 elements.
        slot = block.to(tl.int64) * BLOCK_SIZE + kv_pos % BLOCK_SIZE
        kv_offs = (slot * NUM_KV_HEADS + kv_head)[:, None] * HEAD_DIM + dims[None, :]
        # other=0: slots past the sequence may hold uninitialised memory (NaN * 0 = NaN).
        # An fp8 cache is cast up to the query's dtype (a no-op for a model-dtype cache).
        k = tl.load(k_cache_ptr + kv_offs, mask=in_seq[:, None], other=0.0).to(q.dtype)
        v = tl.load(v_cache_ptr + kv_offs, mask=in_seq[:, None], other=0.0).to(q.dtype)
        scores = _dot(q, tl.trans(k), DOT_PRECISION, UPCAST_DOT)
        if SOFT_CAP > 0:
            scores = _soft_cap(scores * SCALE, SOFT_CAP) * _LOG2E
        else:
            scores = scores * (SCALE * _LOG2E)
        visible = (kv_pos[None, :] <= q_pos[:, None]) & row_valid[:, None]
        if SLIDING_WINDOW > 0:
            visible &= kv_pos[None, :] > q_pos[:, None] - SLIDING_WINDOW
        m, denom, acc = _online_softmax(
            tl.where(visible, scores, float("-inf")), v, m, denom, acc, DOT_PRECISION, UPCAST_DOT
        )

    # Rows that saw no key (padding, or an empty split) have acc == 0 and give 0.
    out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + q_offs, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])
    else:
        part = (split * NUM_TOKENS + q_start + q_local) * NUM_HEADS + head
        tl.store(out_ptr + part[:, None] * HEAD_DIM + dims[None, :], out, mask=row_valid[:, None])
        lse = tl.where(denom > 0, m + tl.log2(tl.where(denom > 0, denom, 1.0)), float("-inf"))
        tl.store(lse_ptr + part, lse, mask=row_valid)


@triton.jit
def merge_splits_kernel(
    part_out_ptr,  # fp32 [NUM_SPLITS, T, Hq, D]
    part_lse_ptr,  # fp32 [NUM_SPLITS, T, Hq]
    sinks_ptr,  # fp32 [Hq]; unused unless HAS_SINKS
    out_ptr,  # [T, Hq, D]
    HAS_SINKS: tl.constexpr,
    NUM_TOKENS: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    """Weights each split's normalised output by its share of the softmax mass (the
    sink's share, when there is one, has no output)."""
    row = tl.program_id(0) * NUM_HEADS + tl.program_id(1)  # token * Hq + head
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, HEAD_DIM)
    part = splits * (NUM_TOKENS * NUM_HEADS) + row
    lse = tl.load(part_lse_ptr + part, mask=splits < NUM_SPLITS, other=float("-inf"))
    top = tl.max(lse, axis=0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + tl.program_id(1)).to(tl.float32) * _LOG2E
        top = tl.maximum(top, sink)
    shift = tl.where(top == float("-inf"), 0.0, top)
    weight = tl.exp2(lse - shift)  # empty split -> 0
    outs = tl.load(
        part_out_ptr + part[:, None] * HEAD_DIM + dims[None, :],
        mask=(splits < NUM_SPLITS)[:, None],
        other=0.0,
    )
    total = tl.sum(weight, axis=0)
    if HAS_SINKS:
        total += tl.exp2(sink - shift)
    out = tl.sum(outs * weight[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + row * HEAD_DIM + dims, out.to(out_ptr.dtype.element_ty))


def launch(
    q: Any,
    k_cache: Any,
    v_cache: Any,
    block_tables: Any,
    seq_lens: Any,
    query_start_loc: Any,
    out: Any,
    part_out: Any,
    part_lse: Any,
    cfg: LaunchConfig,
    scale: float,
    sliding_window: int | None,
    soft_cap: float | None = None,
    sinks: Any = None,
) -> None:
    """Runs the kernels through Triton's own launcher (torch tensors, CUDA or interpreted).

    The caller allocates `out` like q and, for a split launch, the fp32 partials of
    `partial_shapes` (any one-element fp32 tensor otherwise). sinks: fp32 `[Hq]` or None.
    """
    num_tokens, num_heads, _ = q.shape
    num_seqs = block_tables.shape[0]
    params = kernel_params(
        cfg,
        tuple(q.shape),
        tuple(k_cache.shape),
        tuple(block_tables.shape),
        scale,
        sliding_window,
        str(q.dtype).removeprefix("torch."),
        interpret=not isinstance(paged_attention_kernel, triton.runtime.JITFunction),
        soft_cap=soft_cap,
        has_sinks=sinks is not None,
    )
    # Without sinks the pointer is never read; any fp32 tensor stands in.
    sinks_arg = part_lse if sinks is None else sinks
    grid = attention_grid(cfg, num_tokens, num_seqs, k_cache.shape[2])
    split = cfg.num_splits > 1
    args = (q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, sinks_arg)
    paged_attention_kernel[grid](
        *args,
        part_out if split else out,
        part_lse,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **params,
    )
    if split:
        merge = merge_params(cfg, tuple(q.shape), has_sinks=sinks is not None)
        merge_splits_kernel[merge_grid(num_tokens, num_heads)](
            part_out, part_lse, sinks_arg, out, num_warps=cfg.num_warps, **merge
        )
