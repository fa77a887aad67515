"""pack_rows / unpack: the one int32 buffer a step sends to the device."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jvllm.runner.input_batch import (
    BatchShape,
    pack_rows,
    pick_bucket,
    pow2_buckets,
    token_buckets,
    unpack,
)


@dataclasses.dataclass
class Row:
    token_ids: list[int]
    start_position: int
    block_table: list[int]
    prev_step_row: int | None = None
    num_spec_tokens: int = 0
    table_row: int = -1


def random_rows(rng: np.random.Generator, block_size: int) -> list[Row]:
    rows = []
    for _ in range(int(rng.integers(0, 9))):
        n, start = int(rng.integers(1, 20)), int(rng.integers(0, 40))
        blocks = rng.permutation(np.arange(1, 60))[: -(-(start + n) // block_size)]
        rows.append(Row(list(rng.integers(0, 100, n)), start, [int(b) for b in blocks]))
    return rows


def test_pack_rows_matches_a_row_by_row_reading():
    rng = np.random.default_rng(0)
    for _ in range(100):
        rows = random_rows(rng, 8)
        total = sum(len(r.token_ids) for r in rows)
        shape = BatchShape(pick_bucket(total, pow2_buckets(16, 256)), 8, 8)
        inp = unpack(pack_rows(rows, shape, 8), shape, np.zeros(8, np.int32))
        qsl = np.asarray(inp.attn.query_start_loc)
        assert qsl[0] == 0 and (qsl[len(rows) :] == total).all()
        for i, r in enumerate(rows):
            lo, hi = qsl[i], qsl[i + 1]
            pos = np.arange(r.start_position, r.start_position + len(r.token_ids))
            assert list(np.asarray(inp.token_ids)[lo:hi]) == list(r.token_ids)
            assert (np.asarray(inp.positions)[lo:hi] == pos).all()
            table = np.asarray(r.block_table)
            slots = table[pos // 8] * 8 + pos % 8
            assert (np.asarray(inp.attn.slot_mapping)[lo:hi] == slots).all()
            assert int(inp.attn.seq_lens[i]) == pos[-1] + 1
            assert int(inp.logits_indices[i]) == hi - 1
        # Padding writes only into the null block, and padding rows have no tokens.
        assert (np.asarray(inp.attn.slot_mapping)[total:] < 8).all()
        assert (np.asarray(inp.attn.seq_lens)[len(rows) :] == 0).all()


def test_pack_rows_from_a_persistent_block_table_array_packs_the_same():
    """Rows' tables given as rows of one array (the scheduler's BlockTableArray) pack to
    the very buffer their lists do: decode-only steps and ragged ones alike."""
    rng = np.random.default_rng(2)
    for trial in range(100):
        rows = random_rows(rng, 8)
        if trial % 2:  # a decode step: one token a row
            for r in rows:
                r.token_ids = r.token_ids[:1]
        array = np.zeros((3 * len(rows) + 1, 8), np.int32)
        order = rng.permutation(len(array))
        for r, at in zip(rows, order, strict=False):
            r.table_row = int(at)
            array[at, : len(r.block_table)] = r.block_table
        total = sum(len(r.token_ids) for r in rows)
        shape = BatchShape(pick_bucket(max(total, 1), pow2_buckets(16, 256)), 8, 8)
        want = pack_rows(rows, shape, 8)
        assert (pack_rows(rows, shape, 8, array) == want).all()


@pytest.mark.parametrize("tables", ["lists", "array", "narrower array"])
def test_pack_rows_writes_every_entry_of_its_buffer(monkeypatch, tables):
    """The buffer starts uninitialised (most of it is block tables, written anyway):
    every entry must still be written, padding and past-the-table entries with 0."""
    import jvllm.runner.input_batch as input_batch

    rng = np.random.default_rng(3)
    for trial in range(50):
        rows = random_rows(rng, 8)
        if trial % 2:
            for r in rows:
                r.token_ids = r.token_ids[:1]
                r.prev_step_row = 0
        array = None
        if tables != "lists":
            width = 8 if tables == "array" else 6
            rows = [r for r in rows if len(r.block_table) <= width]
            array = np.zeros((len(rows) + 2, width), np.int32)
            for at, r in enumerate(rows):
                r.table_row = at + 1
                array[at + 1, : len(r.block_table)] = r.block_table
        total = sum(len(r.token_ids) for r in rows)
        shape = BatchShape(pick_bucket(max(total, 1), pow2_buckets(16, 256)), 8, 8)
        want = pack_rows(rows, shape, 8, array)
        with monkeypatch.context() as m:
            m.setattr(input_batch.np, "empty", lambda size, dtype: np.full(size, -7, dtype))
            got = pack_rows(rows, shape, 8, array)
        assert (got != -7).all() and (got == want).all()


def test_token_buckets_are_fine_and_end_at_the_budget():
    assert token_buckets(128) == (16, 32, 48, 64, 80, 96, 112, 128)
    buckets = token_buckets(2048)
    assert buckets[-1] == 2048 and list(buckets) == sorted(set(buckets))
    for n in range(1, 2049):  # at most 16 tokens or 25% of padding, whatever the count
        padded = pick_bucket(n, buckets)
        assert padded - n < max(16, 0.25 * n + 1)
    assert token_buckets(100) == (16, 32, 48, 64, 80, 96, 100)


def test_placeholder_tokens_come_from_the_previous_step():
    rows = [Row([1, 2], 0, [1]), Row([0], 5, [2], prev_step_row=3), Row([0], 9, [4], 0)]
    shape = BatchShape(16, 4, 2)
    last_sampled = np.array([70, 71, 72, 73], np.int32)
    inp = unpack(pack_rows(rows, shape, 8), shape, last_sampled)
    assert list(np.asarray(inp.token_ids)[:4]) == [1, 2, 73, 70]
    assert (np.asarray(inp.token_ids)[4:] == 0).all()


@pytest.mark.slow
def test_rows_verifying_drafts_get_a_logits_row_per_position():
    rng = np.random.default_rng(1)
    for _ in range(100):
        rows = random_rows(rng, 8)
        for r in rows:
            r.num_spec_tokens = int(rng.integers(0, len(r.token_ids)))
        total = sum(len(r.token_ids) for r in rows)
        shape = BatchShape(
            pick_bucket(total, pow2_buckets(16, 256)), 8, 8, num_logits=max(total, 1)
        )
        inp = unpack(pack_rows(rows, shape, 8), shape, np.zeros(8, np.int32))
        qsl = np.asarray(inp.attn.query_start_loc)
        want = [
            j
            for i, r in enumerate(rows)
            for j in range(qsl[i + 1] - 1 - r.num_spec_tokens, qsl[i + 1])
        ]
        got = np.asarray(inp.logits_indices)
        assert got.shape == (shape.num_logits,) and list(got[: len(want)]) == want
