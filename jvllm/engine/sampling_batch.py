"""The sampler's persistent batch: each scheduled sequence's sampling inputs in a slot.

Owns per-slot columns that are written when a sequence takes a slot (or the slot's
owner changes) and only read afterwards: the request's `SAMPLER_CONSTANTS` record, its
resolved seed, its prompt length, and whether its rows need a whole `SamplingRow`. A
step's `SamplingColumns` are then numpy gathers by slot; a row's step index is its
sequence length after the row less its prompt length (the tokens sampled before the
row, the one still on the device included). `SamplingRow`s are built only for rows
that need them (bans, penalties, logit bias, beams). Slots are the scheduler's
block-table rows (`ScheduledRequest.table_row`, from `BlockTableArray`), stable while
a request holds blocks.

Not owned: which rows run (the scheduler), the token bitmask and draft rows (steps
with those take `token_constraints.step_sampling`), the padded device arrays (the
runner's `make_sampling_metadata`).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import numpy as np

from jvllm.engine.step_io import RowColumns, SamplingColumns, SamplingRow, ScheduledRequest
from jvllm.engine.token_constraints import IDLE_ROW
from jvllm.sampling_params import SAMPLER_CONSTANTS


class SamplingBatch:
    """Sampling columns by slot; `owners[slot]` is the state they were written for."""

    def __init__(self, num_slots: int = 64) -> None:
        # [slots, fields] float64: each slot's SAMPLER_CONSTANTS record as plain numbers,
        # so that a step's gather copies whole rows (a structured gather copies field
        # by field, several times slower).
        self.constants = np.zeros((num_slots, _NUM_CONSTANTS), np.float64)
        self.seeds = np.zeros(num_slots, np.int64)  # [slots]
        self.prompt_lens = np.zeros(num_slots, np.int64)  # [slots]
        self.needs_row = np.zeros(num_slots, bool)  # [slots]
        self.owners: list[object | None] = [None] * num_slots

    def columns(
        self,
        states: Sequence[Any],
        rows: Sequence[ScheduledRequest],
        eos_token_ids: frozenset[int],
        row_columns: RowColumns | None = None,
    ) -> SamplingColumns:
        """The step's sampling columns, one per row (none may verify drafts): a row that
        samples nothing, or whose sequence finished since it was scheduled, is idle.
        `row_columns`: the rows' columns, when the caller has them."""
        cols = RowColumns.of(rows) if row_columns is None else row_columns
        n = len(rows)
        slots = cols.table_rows  # [n]
        if n and slots.max() >= len(self.owners):
            self._grow(2 * int(slots.max()) + 2)
        self._claim(slots.tolist(), states)
        active = cols.samples  # [n]
        if any(map(_FINISHED, states)):  # only when a commit came between (most steps not)
            active = active & ~np.fromiter(map(_FINISHED, states), bool, n)
        constants = self.constants[slots]  # [n, fields]
        constants[~active] = _IDLE_CONSTANTS
        seeds = np.where(active, self.seeds[slots], 0)
        ends = cols.start_positions + cols.num_tokens
        step_index = np.where(active, ends - self.prompt_lens[slots], 0)
        special: dict[int, SamplingRow] = {}
        for i in np.flatnonzero(active & self.needs_row[slots]).tolist():
            row = special[i] = states[i].sampling_row(eos_token_ids, rows[i])
            # As the row says (a beam samples with its own parameters).
            constants[i] = _record(row.params.sampler_constants)
            seeds[i], step_index[i] = row.seed, row.step_index
        records = constants.view(SAMPLER_CONSTANTS).reshape(n)  # [n] records, no copy
        return SamplingColumns(records, seeds, step_index, special)

    def _claim(self, slots: list[int], states: Sequence[Any]) -> None:
        """(Re)writes the slots whose owner is not the state scheduled there now (each
        slot is below `len(owners)`)."""
        owners = self.owners
        for slot, state in zip(slots, states, strict=True):
            if owners[slot] is not state:
                self._write(slot, state)

    def _write(self, slot: int, state: Any) -> None:
        request = state.request
        params = request.sampling_params
        self.owners[slot] = state
        self.constants[slot] = _record(params.sampler_constants)
        self.prompt_lens[slot] = request.num_prompt_tokens
        self.needs_row[slot] = not state.plain_sampling
        self.seeds[slot] = state.seed if state.plain_sampling else 0

    def _grow(self, num_slots: int) -> None:
        old = len(self.owners)
        for name in ("constants", "seeds", "prompt_lens", "needs_row"):
            column = getattr(self, name)
            grown = np.zeros((num_slots, *column.shape[1:]), column.dtype)
            grown[:old] = column
            setattr(self, name, grown)
        self.owners += [None] * (num_slots - old)


def _record(constants: bytes) -> np.ndarray:
    """A `SAMPLER_CONSTANTS` record's bytes as its fields' float64 numbers `[fields]`."""
    return np.frombuffer(constants, np.float64)


_NUM_CONSTANTS = len(SAMPLER_CONSTANTS.names)
assert np.dtype([(f, np.float64) for f in SAMPLER_CONSTANTS.names]) == SAMPLER_CONSTANTS
_IDLE_CONSTANTS = _record(IDLE_ROW.params.sampler_constants)
_FINISHED = operator.attrgetter("finished")
