"""A step's rows: `ScheduledRequest`s, and `StepRows`, which keeps decode rows as columns.

Owns the row types of the engine/runner boundary (`step_io` re-exports them; the
runner imports them from there): `ScheduledRequest`, one request's share of a step;
`StepRows`, the scheduler's rows of one step in order; `RowColumns`, any rows' numbers
as numpy columns.

Most rows of most steps are steady decode rows: one token, the one the previous step
samples (still on the device), no drafts. `StepRows` keeps those as columns only (the
request, its start position and block-table row in plain lists the scheduler appends
to; its previous sampling row from the scheduler's per-table-row array), and every
other row (prompt chunks, rows with drafts, beams) whole. Packing, the sampling
columns and committing read the columns; a `ScheduledRequest` of a steady row is made
only when something asks for it (`rows[i]`, iteration), as vLLM's scheduler sends
its running requests as columns (`CachedRequestData`) rather than one object each.

Not owned: which rows run (the scheduler), what the runner makes of them (`pack_rows`).
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple, overload

import numpy as np

if TYPE_CHECKING:
    from jvllm.engine.request import Request

# The token id a row carries where the device substitutes the previous step's sample.
PLACEHOLDER_TOKEN = 0


class ScheduledRequest(NamedTuple):
    """One request's share of a step (a NamedTuple: one is built per row and step)."""

    request_id: str
    token_ids: list[int]  # all_token_ids[start_position : start_position + len(token_ids)]
    start_position: int  # num_computed_tokens before the step: the position of token_ids[0]
    # The request's table itself, valid until the next schedule(): it covers at least
    # start_position + len(token_ids) positions.
    block_table: list[int]
    samples: bool  # every known token is computed after this step, so one is sampled
    # Set when the row's one token is the one the previous step's row of this index
    # sampled, still unknown to the host (token_ids then holds PLACEHOLDER_TOKEN).
    prev_step_row: int | None = None
    # The last this many of token_ids are draft tokens to verify (speculative decoding).
    num_spec_tokens: int = 0
    # Its block table's row in the step's `SchedulerOutput.block_tables` (-1: none).
    table_row: int = -1


class StepRows(Sequence[ScheduledRequest]):
    """One step's rows in order: steady decode rows as columns, the others whole.

    Row i is `requests[i]`'s; it starts at `starts[i]` and its block table is row
    `table_rows[i]` of the step's block-table array. `whole` holds the rows that are not
    steady decode rows, by index; a steady row is one placeholder token that samples,
    whose previous row is known once the scheduler `seal`s the rows
    (`ScheduledRequest(id, [PLACEHOLDER_TOKEN], start, table, True, prev, 0, table_row)`).
    """

    __slots__ = ("requests", "starts", "table_rows", "whole", "_tables", "_columns")

    def __init__(self, block_tables: Mapping[str, list[int]]) -> None:
        """`block_tables`: request id -> its table (the KV cache manager's own dict),
        read when a steady row is made whole."""
        self.requests: list[Request] = []
        self.starts: list[int] = []
        self.table_rows: list[int] = []
        self.whole: dict[int, ScheduledRequest] = {}
        self._tables = block_tables
        self._columns: RowColumns | None = None

    def add(self, row: ScheduledRequest, request: Request) -> None:
        """Appends a row that is not a steady decode row."""
        self.whole[len(self.requests)] = row
        self.requests.append(request)
        self.starts.append(row.start_position)
        self.table_rows.append(row.table_row)

    def seal(self, previous_rows: np.ndarray) -> RowColumns:
        """The rows' columns, taken once every row is in: a steady row's previous row is
        `previous_rows[its table row]` (`[table rows]`: each table row's sampling row in
        the step before), a whole row's its own."""
        assert self._columns is None, "sealed twice"
        n = len(self.requests)
        # fromiter: half np.array's cost for a list of ints (hundreds a step).
        table_rows = np.fromiter(self.table_rows, np.int64, n)  # [n]
        num_tokens = np.ones(n, np.int64)  # [n]
        samples = np.ones(n, bool)  # [n]
        num_spec = np.zeros(n, np.int64)  # [n]
        prev = previous_rows[table_rows]  # [n]
        assert (np.delete(prev, list(self.whole)) >= 0).all(), "a steady row without one"
        for i, row in self.whole.items():
            num_tokens[i] = len(row.token_ids)
            num_spec[i] = row.num_spec_tokens
            samples[i] = row.samples
            prev[i] = -1 if row.prev_step_row is None else row.prev_step_row
        starts = np.fromiter(self.starts, np.int64, n)  # [n]
        self._columns = RowColumns(num_tokens, starts, table_rows, prev, samples, num_spec)
        return self._columns

    def columns(self, with_samples: bool = True) -> RowColumns:
        """The sealed columns (`samples` all False without `with_samples`)."""
        assert self._columns is not None, "seal the rows first"
        if with_samples:
            return self._columns
        return self._columns._replace(samples=np.zeros(len(self.requests), bool))

    def __len__(self) -> int:
        return len(self.requests)

    @overload
    def __getitem__(self, index: int) -> ScheduledRequest: ...

    @overload
    def __getitem__(self, index: slice) -> list[ScheduledRequest]: ...

    def __getitem__(self, index: int | slice) -> ScheduledRequest | list[ScheduledRequest]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self.requests)
        row = self.whole.get(index)
        if row is not None:
            return row
        request_id = self.requests[index].request_id
        return ScheduledRequest(
            request_id,
            [PLACEHOLDER_TOKEN],
            self.starts[index],
            self._tables.get(request_id, []),  # [] once the request finished
            True,
            int(self.columns().prev_step_rows[index]),
            0,
            self.table_rows[index],
        )

    def __iter__(self) -> Iterator[ScheduledRequest]:
        return (self[i] for i in range(len(self.requests)))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, StepRows | list | tuple):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable, as a list

    def __repr__(self) -> str:
        return f"StepRows({list(self)!r})"


class RowColumns(NamedTuple):
    """A step's rows as columns (entry i is `scheduled[i]`'s): what both the runner's
    packing (`pack_rows`) and the engine's sampling batch read of every row, taken
    from the rows once per step (`SchedulerOutput.columns`)."""

    num_tokens: np.ndarray  # [n] int64: len(token_ids)
    start_positions: np.ndarray  # [n] int64
    table_rows: np.ndarray  # [n] int64 (-1: none)
    prev_step_rows: np.ndarray  # [n] int64 (-1: none)
    samples: np.ndarray  # [n] bool
    num_spec_tokens: np.ndarray  # [n] int64

    @classmethod
    def of(cls, rows: Sequence[ScheduledRequest], with_samples: bool = True) -> RowColumns:
        """The rows' columns; `samples` all False without `with_samples` (rows that do
        not say, as the runner's pieces of rows cut between micro-batches)."""
        if isinstance(rows, StepRows):
            return rows.columns(with_samples)
        n = len(rows)
        # map() over attrgetters: C-level loops, no generator frame per column.
        try:  # a decode step: every row feeds back a previous row's token
            prev = np.fromiter(map(_PREV_STEP_ROW, rows), np.int64, n)
        except TypeError:  # some row has none
            prev = np.array([-1 if p is None else p for p in map(_PREV_STEP_ROW, rows)], np.int64)
        return cls(
            np.fromiter(map(len, map(_TOKEN_IDS, rows)), np.int64, n),
            np.fromiter(map(_START, rows), np.int64, n),
            np.fromiter(map(_TABLE_ROW, rows), np.int64, n),
            prev,
            np.fromiter(map(_SAMPLES, rows), bool, n) if with_samples else np.zeros(n, bool),
            np.fromiter(map(_NUM_SPEC, rows), np.int64, n),
        )


_TOKEN_IDS = operator.attrgetter("token_ids")
_START = operator.attrgetter("start_position")
_TABLE_ROW = operator.attrgetter("table_row")
_PREV_STEP_ROW = operator.attrgetter("prev_step_row")
_SAMPLES = operator.attrgetter("samples")
_NUM_SPEC = operator.attrgetter("num_spec_tokens")
