"""Flattens one step's scheduled sequences into padded arrays for the jitted step.

Owns bucket padding and the packing of all int32 step metadata into ONE host
buffer (one transfer per step); `unpack` rebuilds `ModelInput` inside jit from
static sizes. Padding tokens write into the null block 0 and padding rows have
seq_len 0, so neither touches a real sequence's output.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np

from jvllm.layers.attention import AttentionMetadata


class StepRow(Protocol):
    """One sequence's work this step (the scheduler's `ScheduledRequest` fits)."""

    token_ids: Sequence[int]
    start_position: int
    block_table: Sequence[int]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ModelInput:
    token_ids: jax.Array  # [T] int32
    positions: jax.Array  # [T] int32
    attn: AttentionMetadata
    logits_indices: jax.Array  # [S] int32: row of each sequence's last new token


@dataclasses.dataclass(frozen=True)
class BatchShape:
    """The static sizes of one compiled step: padded tokens, rows, block-table width."""

    num_tokens: int
    num_seqs: int
    width: int


def pow2_buckets(smallest: int, largest: int) -> tuple[int, ...]:
    """Powers of two from `smallest` up to and including `largest` (itself the last)."""
    out, b = [], smallest
    while b < largest:
        out.append(b)
        b *= 2
    return (*out, largest)


def pick_bucket(n: int, buckets: Sequence[int]) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


def pack_rows(rows: Sequence[StepRow], shape: BatchShape, block_size: int) -> np.ndarray:
    """All int32 metadata of one step in one flat buffer, in `unpack`'s order.

    Vectorised over rows: the per-step host cost matters at hundreds of sequences.
    """
    t_pad, s_pad, w = shape.num_tokens, shape.num_seqs, shape.width
    n = len(rows)
    assert n <= s_pad
    lens = np.fromiter((len(r.token_ids) for r in rows), np.int64, n)
    starts = np.fromiter((r.start_position for r in rows), np.int64, n)
    widths = np.fromiter((len(r.block_table) for r in rows), np.int64, n)
    total = int(lens.sum())
    assert total <= t_pad and (widths <= w).all(), (total, t_pad, widths.max(initial=0), w)
    qsl = np.full(s_pad + 1, total, np.int32)
    qsl[0] = 0
    qsl[1 : n + 1] = np.cumsum(lens)
    seq_lens = np.zeros(s_pad, np.int32)
    seq_lens[:n] = starts + lens
    tables = np.zeros((s_pad, w), np.int32)
    flat_tables = np.fromiter(
        itertools.chain.from_iterable(r.block_table for r in rows), np.int32, int(widths.sum())
    )
    table_rows = np.repeat(np.arange(n), widths)
    tables[
        table_rows, np.arange(len(flat_tables)) - np.repeat(np.cumsum(widths) - widths, widths)
    ] = flat_tables
    tokens = np.zeros(t_pad, np.int32)
    tokens[:total] = np.fromiter(
        itertools.chain.from_iterable(r.token_ids for r in rows), np.int32, total
    )
    seq_of_token = np.repeat(np.arange(n), lens)
    pos = np.arange(total) - np.repeat(qsl[:n].astype(np.int64), lens) + starts[seq_of_token]
    positions = np.zeros(t_pad, np.int32)
    positions[:total] = pos
    slots = np.zeros(t_pad, np.int32)  # padding -> slot 0 of the null block
    slots[:total] = tables[seq_of_token, pos // block_size] * block_size + pos % block_size
    logits_indices = np.maximum(qsl[1:] - 1, 0).astype(np.int32)
    return np.concatenate([tokens, positions, slots, qsl, seq_lens, tables.ravel(), logits_indices])


def unpack(packed: jax.Array, shape: BatchShape) -> ModelInput:
    """Inverse of `pack_rows`, traced inside jit (static slices are free)."""
    t, s, w = shape.num_tokens, shape.num_seqs, shape.width
    sizes = [t, t, t, s + 1, s, s * w, s]
    parts = jnp.split(packed, np.cumsum(sizes)[:-1])
    tokens, positions, slots, qsl, seq_lens, tables, logits_indices = parts
    return ModelInput(
        token_ids=tokens,
        positions=positions,
        attn=AttentionMetadata(slots, qsl, seq_lens, tables.reshape(s, w)),
        logits_indices=logits_indices,
    )
