"""BlockTableArray: the persistent int32 copy of every request's block table."""

from __future__ import annotations

import numpy as np

from jvllm.engine.kv.block_table_array import BlockTableArray


def _check(tables: BlockTableArray, want: dict[str, list[int]]) -> None:
    """Each request's row holds its table and zeros after it; other rows are all zero."""
    assert len(tables) == len(want)
    used = set()
    for request_id, table in want.items():
        row = tables.row(request_id)
        assert row not in used
        used.add(row)
        assert list(tables.array[row, : len(table)]) == table
        assert not tables.array[row, len(table) :].any()
    free = [r for r in range(len(tables.array)) if r not in used]
    assert not tables.array[free].any()


def test_writes_grow_shrink_release_and_reuse_rows():
    tables = BlockTableArray(width=2, num_rows=1)
    tables.write("a", [5])
    tables.write("b", [7, 8, 9])  # a second row and a third column
    assert tables.array.shape == (2, 3)
    tables.write("a", [5, 6])
    tables.append("a", 4)
    tables.append("a", 3)  # a fourth column
    assert tables.array.shape == (2, 4)
    _check(tables, {"a": [5, 6, 4, 3], "b": [7, 8, 9]})
    tables.write("a", [5, 6])
    tables.write("b", [0])  # swapped out: shorter, zeros after
    _check(tables, {"a": [5, 6], "b": [0]})
    row_a = tables.row("a")
    tables.release("a")
    tables.release("a")  # releasing twice is fine
    assert "a" not in tables and "b" in tables
    tables.write("c", [1, 2])
    assert tables.row("c") == row_a  # a released row is taken again
    _check(tables, {"b": [0], "c": [1, 2]})


def test_random_trace_matches_the_lists():
    """Random writes, rewrites and releases, against a dict of lists."""
    rng = np.random.default_rng(0)
    tables = BlockTableArray(width=4, num_rows=2)
    want: dict[str, list[int]] = {}
    for step in range(2000):
        request_id = f"r{int(rng.integers(0, 40))}"
        if request_id in want and rng.random() < 0.3:
            tables.release(request_id)
            del want[request_id]
        elif request_id in want and rng.random() < 0.4:  # a decode row's new block
            block = int(rng.integers(1, 1000))
            tables.append(request_id, block)
            want[request_id].append(block)
        else:
            table = [int(b) for b in rng.integers(1, 1000, int(rng.integers(0, 9)))]
            tables.write(request_id, table)
            want[request_id] = table
        if step % 50 == 0:
            _check(tables, want)
    _check(tables, want)
    assert tables.array.shape[1] >= 8 and len(tables.array) >= len(want)
