"""Flattens one step's scheduled sequences into padded arrays for the jitted step.

Owns bucket padding and the packing of all int32 step metadata into ONE host
buffer (one transfer per step); `unpack` rebuilds `ModelInput` inside jit from
static sizes, taking each placeholder token (a decode row whose input the previous
step sampled, not yet seen by the host) from that step's sampled array on the device.
Padding tokens write into the null block 0 and padding rows have seq_len 0, so
neither touches a real sequence's output.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
from collections.abc import Sequence
from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from jvllm.engine.step_io import RowColumns, StepRows
from jvllm.layers.attention import AttentionMetadata


class StepRow(Protocol):
    """One sequence's work this step (the scheduler's `ScheduledRequest` fits)."""

    token_ids: Sequence[int]
    start_position: int
    block_table: Sequence[int]
    prev_step_row: int | None  # row of the previous step whose sample is token_ids[0]
    num_spec_tokens: int  # the last this many tokens are drafts: each needs its logits
    table_row: int  # block_table as a row of the step's block-table array (-1: none)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ModelInput:
    token_ids: jax.Array  # [T] int32
    positions: jax.Array  # [T] int32
    attn: AttentionMetadata
    # [L] int32: the token of each logits row: each sequence's last new token, or its
    # last 1 + k (a row verifying k draft tokens); L = S without speculative decoding.
    logits_indices: jax.Array
    # [T] int32 with LoRA on (`BatchShape.lora`): each token's adapter slot, 0 the base
    # model (`lora/punica.py`).
    lora_slots: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class BatchShape:
    """The static sizes of one compiled step: padded tokens, rows, block-table width,
    and logits rows (0: one per row; more with speculative decoding's draft tokens).
    With pipeline stages the rows run as `num_micro` micro-batches of `micro` shape
    (`num_tokens` = num_micro * micro tokens)."""

    num_tokens: int
    num_seqs: int
    width: int
    num_logits: int = 0
    num_micro: int = 1
    micro_seqs: int = 0
    lora: bool = False  # each token's LoRA slot travels too

    @property
    def logits_rows(self) -> int:
        return self.num_logits or self.num_seqs

    @property
    def micro(self) -> BatchShape:
        """One micro-batch's shape (its own logits indices go unused: the step's, in row
        order, pick the logits rows; with draft tokens there is room for any row's)."""
        t = self.num_tokens // self.num_micro
        return BatchShape(t, self.micro_seqs, self.width, t if self.num_logits else 0)


def pow2_buckets(smallest: int, largest: int, ratio: int = 2) -> tuple[int, ...]:
    """`smallest` times powers of `ratio` (two unless given) below `largest`, then
    `largest` itself."""
    out, b = [], smallest
    while b < largest:
        out.append(b)
        b *= ratio
    return (*out, largest)


def token_buckets(largest: int, smallest: int = 16, steps_per_octave: int = 4) -> tuple[int, ...]:
    """Token-count buckets: multiples of `smallest` up to 8 * smallest, then
    `steps_per_octave` evenly spaced sizes per doubling, and `largest` itself last.

    A step of n real tokens runs in at most ~25% more (at most `smallest` - 1 more at
    the small end), where powers of two waste up to half; each size is one program.
    """
    out, b = [], smallest
    linear_until = 8 * smallest
    while b < largest:
        out.append(b)
        if b < linear_until:
            b += smallest
        else:
            octave = 1 << (b.bit_length() - 1)  # the power of two at or below b
            b += octave // steps_per_octave
    return (*out, largest)


def pick_bucket(n: int, buckets: Sequence[int]) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


def pack_rows(
    rows: Sequence[StepRow],
    shape: BatchShape,
    block_size: int,
    block_tables: np.ndarray | None = None,
    lora_slots: np.ndarray | None = None,
    columns: RowColumns | None = None,
) -> np.ndarray:
    """All int32 metadata of one step in one flat buffer, in `unpack`'s order. With
    `block_tables` (the scheduler's persistent array, `SchedulerOutput.block_tables`)
    each row's table is row `table_row` of it: one gather, not a conversion of every
    entry of every `block_table`. With `shape.lora`, each token's LoRA slot follows,
    from `lora_slots` `[n]` (one per row; None: the base model's 0). `columns`: the
    rows' `RowColumns` when the caller has them (`SchedulerOutput.columns`).

    Vectorised over rows: the per-step host cost matters at hundreds of sequences.
    """
    t_pad, s_pad, w = shape.num_tokens, shape.num_seqs, shape.width
    n = len(rows)
    assert n <= s_pad
    cols = RowColumns.of(rows, with_samples=False) if columns is None else columns
    lens, starts, prev = cols.num_tokens, cols.start_positions, cols.prev_step_rows
    total = int(lens.sum())
    assert total <= t_pad, (total, t_pad)
    # Every part is a view of the one buffer (`unpack`'s order): no concatenation.
    # Zeroed but for the block tables, written below (at hundreds of rows, most of it).
    sizes = _packed_sizes(shape)
    tables_at = sum(sizes[:5])
    packed = np.empty(sum(sizes), np.int32)
    packed[:tables_at] = 0
    packed[tables_at + s_pad * w :] = 0
    tokens, positions, slots, qsl, seq_lens, flat_tables, logits_indices, prev_index = (
        _packed_parts(packed, shape)[:8]
    )
    qsl[n + 1 :] = total
    np.cumsum(lens, out=qsl[1 : n + 1])
    seq_lens[:n] = starts + lens
    tables = flat_tables.reshape(s_pad, w)  # [S, W]
    tables[n:] = 0  # padding rows
    if block_tables is not None:
        # Zero past each table's end, and no table is wider than max_model_len's.
        table_width = block_tables.shape[1]
        assert table_width <= w, (block_tables.shape, w)
        table_rows = cols.table_rows
        assert (table_rows >= 0).all(), "every row needs its table_row"
        assert (table_rows < len(block_tables)).all(), "a table_row past the tables"
        if table_width == w:  # gathered straight into the buffer (clip: no bounce copy)
            np.take(block_tables, table_rows, axis=0, out=tables[:n], mode="clip")
        else:
            tables[:n, :table_width] = block_tables[table_rows]
            tables[:n, table_width:] = 0
    else:
        tables[:n] = 0
        widths = np.fromiter(map(len, map(_TABLE, rows)), np.int64, n)
        assert (widths <= w).all(), (widths.max(initial=0), w)
        flat = np.fromiter(
            itertools.chain.from_iterable(map(_TABLE, rows)), np.int32, int(widths.sum())
        )
        table_rows = np.repeat(np.arange(n), widths)
        within = np.arange(len(flat)) - np.repeat(np.cumsum(widths) - widths, widths)
        tables[table_rows, within] = flat
    fed_back = prev >= 0  # [n]: the rows whose one token the device fills in
    if total != n or not fed_back.all():  # else every token is a placeholder (async decode)
        _fill_tokens(tokens, rows, qsl, total)
    if total == n:
        # Every row one token (a decode step, no drafts): token i is row i's.
        seq_of_token, pos, firsts = np.arange(n), starts, np.arange(n)
        logits_indices[:] = max(n - 1, 0)
        logits_indices[:n] = firsts
    else:
        seq_of_token = np.repeat(np.arange(n), lens)
        pos = np.arange(total) - np.repeat(qsl[:n].astype(np.int64), lens) + starts[seq_of_token]
        firsts = qsl[:n]
        logits_indices[:] = _logits_indices(cols.num_spec_tokens, qsl, shape.logits_rows)
    positions[:total] = pos
    # Padding -> slot 0 of the null block.
    slots[:total] = tables[seq_of_token, pos // block_size] * block_size + pos % block_size
    prev_index[:] = -1  # [T]: -1, or a row of the previous step
    prev_index[firsts[fed_back]] = prev[fed_back]
    if shape.lora and lora_slots is not None:
        token_lora = _packed_parts(packed, shape)[8]  # [T]
        token_lora[:total] = np.repeat(lora_slots, lens)
    return packed


_TOKEN_IDS = operator.attrgetter("token_ids")
_TABLE = operator.attrgetter("block_table")
_NUM_SPEC_TOKENS = operator.attrgetter("num_spec_tokens")


def total_tokens(rows: Sequence[StepRow]) -> int:
    """The rows' tokens in all (a C-level loop: hundreds of rows a step; a `StepRows`'
    steady decode rows count one each, unread)."""
    if isinstance(rows, StepRows):
        return len(rows) + sum(len(row.token_ids) - 1 for row in rows.whole.values())
    return sum(map(len, map(_TOKEN_IDS, rows)))


def total_spec_tokens(rows: Sequence[StepRow]) -> int:
    """The rows' draft tokens in all."""
    if isinstance(rows, StepRows):  # a steady decode row has none
        return sum(map(_NUM_SPEC_TOKENS, rows.whole.values()))
    return sum(map(_NUM_SPEC_TOKENS, rows))


def row_lengths(rows: Sequence[StepRow]) -> tuple[int, ...]:
    """Each row's token count."""
    if isinstance(rows, StepRows):
        return tuple(RowColumns.of(rows).num_tokens.tolist())
    return tuple(map(len, map(_TOKEN_IDS, rows)))


def _fill_tokens(tokens: np.ndarray, rows: Sequence[StepRow], qsl: np.ndarray, total: int) -> None:
    """The rows' token ids into `tokens` `[T]` (zeroed). A `StepRows`' steady decode rows
    hold a placeholder (0) only: just its whole rows are written."""
    if isinstance(rows, StepRows):
        for i, row in rows.whole.items():
            tokens[qsl[i] : qsl[i + 1]] = row.token_ids
        return
    tokens[:total] = np.fromiter(
        itertools.chain.from_iterable(map(_TOKEN_IDS, rows)), np.int32, total
    )


def _logits_indices(num_spec: np.ndarray, qsl: np.ndarray, num_logits: int) -> np.ndarray:
    """Each row's last 1 + num_spec_tokens token indices (`num_spec` `[n]`), in row
    order; padding repeats the last real token (its logits are never read)."""
    n = len(num_spec)
    out = np.full(num_logits, max(int(qsl[n]) - 1, 0), np.int32)
    counts = 1 + num_spec
    total = int(counts.sum())
    assert total <= num_logits, (total, num_logits)
    firsts = np.cumsum(counts) - counts  # each row's first logits row
    within = np.arange(total) - np.repeat(firsts, counts)
    out[:total] = np.repeat(qsl[1 : n + 1] - counts, counts) + within
    return out


def _packed_sizes(shape: BatchShape) -> list[int]:
    t, s, w = shape.num_tokens, shape.num_seqs, shape.width
    return [t, t, t, s + 1, s, s * w, shape.logits_rows, t] + ([t] if shape.lora else [])


def _packed_parts(packed: np.ndarray, shape: BatchShape) -> list[np.ndarray]:
    """Views of `pack_rows`' buffer, one per part (`_packed_sizes`)."""
    bounds = itertools.accumulate(_packed_sizes(shape), initial=0)
    ends = list(bounds)
    return [packed[a:b] for a, b in itertools.pairwise(ends)]


def unpack(packed: jax.Array, shape: BatchShape, last_sampled: jax.Array) -> ModelInput:
    """Inverse of `pack_rows`, traced inside jit (static slices are free); placeholder
    tokens become the previous step's samples, `last_sampled` `[R]` int32."""
    s, w = shape.num_seqs, shape.width
    parts = jnp.split(packed, np.cumsum(_packed_sizes(shape))[:-1])
    tokens, positions, slots, qsl, seq_lens, tables, logits_indices, prev_index = parts[:8]
    tokens = jnp.where(prev_index >= 0, last_sampled[jnp.maximum(prev_index, 0)], tokens)
    return ModelInput(
        token_ids=tokens,
        positions=positions,
        attn=AttentionMetadata(slots, qsl, seq_lens, tables.reshape(s, w)),
        logits_indices=logits_indices,
        lora_slots=parts[8] if shape.lora else None,
    )


class RowPiece(NamedTuple):
    """Part of a row's tokens that a cut between micro-batches made (a `StepRow`)."""

    token_ids: Sequence[int]
    start_position: int
    block_table: Sequence[int]
    prev_step_row: int | None
    num_spec_tokens: int
    table_row: int = -1


def cut_rows(rows: Sequence[StepRow], parts: int) -> list[list[StepRow]]:
    """The rows' tokens, in order, cut into `parts` runs of `micro_batch_tokens` tokens
    (the last run shorter, or runs empty, when they do not divide). A row across a cut
    becomes pieces, each starting where the one before ends: a later micro-batch's
    piece attends to the earlier piece's KV, which every stage wrote a tick before."""
    size = micro_batch_tokens(rows, parts)
    groups: list[list[StepRow]] = [[] for _ in range(parts)]
    g, room = 0, size
    for row in rows:
        ids, start = row.token_ids, row.start_position
        if len(ids) <= room:  # the common case: the row fits whole
            groups[g].append(row)
            room -= len(ids)
        else:
            # A piece's own logits indices go unused (the step's pick the row's last
            # 1 + num_spec_tokens tokens, wherever the cut put them).
            prev, done = row.prev_step_row, 0
            while done < len(ids):
                take = min(len(ids) - done, room)
                piece = ids[done : done + take]
                groups[g].append(
                    RowPiece(piece, start + done, row.block_table, prev, 0, row.table_row)
                )
                prev, done, room = None, done + take, room - take
                if room == 0 and done < len(ids):
                    g, room = g + 1, size
        if room == 0 and g < parts - 1:
            g, room = g + 1, size
    return groups


def micro_batch_tokens(rows: Sequence[StepRow], parts: int) -> int:
    """Tokens per micro-batch when `rows` are cut into `parts` (the step's bucket is
    this size's)."""
    return -(-total_tokens(rows) // parts)


def pack_micro_batches(
    rows: Sequence[StepRow],
    shape: BatchShape,
    block_size: int,
    block_tables: np.ndarray | None = None,
) -> tuple[np.ndarray, list[int]]:
    """A pipelined step's int32 metadata in one buffer (`unpack_micro_batches`'s order):
    each micro-batch's `pack_rows` buffer (`cut_rows`), then where each token of the
    rows, in row order, sits among the micro-batches' `[num_micro * micro tokens]`,
    then the logits indices in row order. Also each micro-batch's token count."""
    micro = shape.micro
    parts, sizes, token_index = [], [], np.zeros(shape.num_tokens, np.int32)
    offset = 0
    for g, group in enumerate(cut_rows(rows, shape.num_micro)):
        parts.append(pack_rows(group, micro, block_size, block_tables))
        n = sum(len(r.token_ids) for r in group)
        token_index[offset : offset + n] = g * micro.num_tokens + np.arange(n)
        offset += n
        sizes.append(n)
    cols = RowColumns.of(rows, with_samples=False)
    qsl = np.concatenate([[0], np.cumsum(cols.num_tokens)])
    logits_indices = _logits_indices(cols.num_spec_tokens, qsl, shape.logits_rows)
    return np.concatenate([*parts, token_index, logits_indices]), sizes


def unpack_micro_batches(
    packed: jax.Array, shape: BatchShape, last_sampled: jax.Array
) -> tuple[ModelInput, jax.Array, jax.Array]:
    """Inverse of `pack_micro_batches`: the micro-batches' inputs stacked `[M, ...]`,
    the token index `[T]` and the logits indices `[L]` (both in row order)."""
    micro = shape.micro
    size = sum(_packed_sizes(micro))
    inputs = [
        unpack(packed[g * size : (g + 1) * size], micro, last_sampled)
        for g in range(shape.num_micro)
    ]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *inputs)
    rest = packed[shape.num_micro * size :]
    token_index = rest[: shape.num_tokens]
    logits_indices = rest[shape.num_tokens : shape.num_tokens + shape.logits_rows]
    return stacked, token_index, logits_indices
