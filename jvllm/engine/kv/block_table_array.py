"""BlockTableArray: every request's block table also kept as a row of one int32 array.

Owns the persistent numpy copy of the block tables that `KVCacheManager` keeps as
lists: which array row each request holds, and that row's contents, rewritten whenever
its table changes (one decode step in `block_size` for a decoding request) and zero
past the table's end (the null block, as padding). A step's tables are then one gather
of its requests' rows (`pack_rows`), instead of converting every entry of every table.
Rows are reused once released; the array grows (rows, or columns past `width`) when
it must, so a reference taken at `schedule()` time is valid until the next one.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class BlockTableArray:
    def __init__(self, width: int, num_rows: int = 64) -> None:
        self.array = np.zeros((max(num_rows, 1), max(width, 1)), np.int32)
        self._lengths = [0] * len(self.array)
        self._row_of: dict[str, int] = {}
        self._free = list(range(len(self.array) - 1, -1, -1))  # popped from the end

    def row(self, request_id: str) -> int:
        """The request's row (it must hold one: its table was written)."""
        return self._row_of[request_id]

    @property
    def row_of(self) -> dict[str, int]:
        """Request id -> its row, for reading many (the scheduler's per-row loop)."""
        return self._row_of

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._row_of

    def __len__(self) -> int:
        """Rows in use."""
        return len(self._row_of)

    def write(self, request_id: str, table: Sequence[int]) -> None:
        """Makes the request's row equal `table` (taking a row on first use)."""
        row = self._row_of.get(request_id)
        if row is None:
            row = self._row_of[request_id] = self._take()
        n, old = len(table), self._lengths[row]
        if n > self.array.shape[1]:
            self._grow(columns=n)
        self.array[row, :n] = table
        if old > n:
            self.array[row, n:old] = 0
        self._lengths[row] = n

    def append(self, request_id: str, block_id: int) -> None:
        """Adds one block to the end of the request's row (which it must hold)."""
        row = self._row_of[request_id]
        n = self._lengths[row]
        if n == self.array.shape[1]:
            self._grow(columns=n + 1)
        self.array[row, n] = block_id
        self._lengths[row] = n + 1

    def release(self, request_id: str) -> None:
        """Frees the request's row (zeroed); a request without one is fine."""
        row = self._row_of.pop(request_id, None)
        if row is None:
            return
        self.array[row, : self._lengths[row]] = 0
        self._lengths[row] = 0
        self._free.append(row)

    def _take(self) -> int:
        if not self._free:
            self._grow(rows=2 * len(self.array))
        return self._free.pop()

    def _grow(self, rows: int = 0, columns: int = 0) -> None:
        """A larger array, contents kept (earlier references keep the old one)."""
        old_rows, old_columns = self.array.shape
        new_rows, new_columns = max(rows, old_rows), max(columns, old_columns)
        grown = np.zeros((new_rows, new_columns), np.int32)
        grown[:old_rows, :old_columns] = self.array
        self.array = grown
        self._lengths += [0] * (new_rows - old_rows)
        self._free[:0] = range(new_rows - 1, old_rows - 1, -1)  # after the old free rows
