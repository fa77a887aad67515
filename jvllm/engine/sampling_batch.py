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

from jvllm.engine.step_io import SamplingColumns, SamplingRow, ScheduledRequest
from jvllm.engine.token_constraints import IDLE_ROW
from jvllm.sampling_params import SAMPLER_CONSTANTS


class SamplingBatch:
    """Sampling columns by slot; `owners[slot]` is the state they were written for."""

    def __init__(self, num_slots: int = 64) -> None:
        self.constants = np.zeros(num_slots, SAMPLER_CONSTANTS)  # [slots]
        self.seeds = np.zeros(num_slots, np.int64)  # [slots]
        self.prompt_lens = np.zeros(num_slots, np.int64)  # [slots]
        self.needs_row = np.zeros(num_slots, bool)  # [slots]
        self.owners: list[object | None] = [None] * num_slots

    def columns(
        self, states: Sequence[Any], rows: Sequence[ScheduledRequest], eos_token_ids: frozenset[int]
    ) -> SamplingColumns:
        """The step's sampling columns, one per row (none may verify drafts): a row that
        samples nothing, or whose sequence finished since it was scheduled, is idle."""
        n = len(rows)
        slots = np.fromiter(map(_TABLE_ROW, rows), np.int64, n)  # [n]
        self._claim(slots.tolist(), states)
        samples = np.fromiter(map(_SAMPLES, rows), bool, n)
        finished = np.fromiter(map(_FINISHED, states), bool, n)
        ends = np.fromiter(map(_START, rows), np.int64, n)
        ends += np.fromiter(map(len, map(_TOKEN_IDS, rows)), np.int64, n)
        active = samples & ~finished  # [n]
        constants = self.constants[slots]
        constants[~active] = _IDLE_CONSTANTS
        seeds = np.where(active, self.seeds[slots], 0)
        step_index = np.where(active, ends - self.prompt_lens[slots], 0)
        special: dict[int, SamplingRow] = {}
        for i in np.flatnonzero(active & self.needs_row[slots]).tolist():
            row = special[i] = states[i].sampling_row(eos_token_ids, rows[i])
            # As the row says (a beam samples with its own parameters).
            constants[i] = np.frombuffer(row.params.sampler_constants, SAMPLER_CONSTANTS)[0]
            seeds[i], step_index[i] = row.seed, row.step_index
        return SamplingColumns(constants, seeds, step_index, special)

    def _claim(self, slots: list[int], states: Sequence[Any]) -> None:
        """(Re)writes the slots whose owner is not the state scheduled there now."""
        if slots and max(slots) >= len(self.owners):
            self._grow(2 * max(slots) + 2)
        owners = self.owners
        for slot, state in zip(slots, states, strict=True):
            if owners[slot] is not state:
                self._write(slot, state)

    def _write(self, slot: int, state: Any) -> None:
        request = state.request
        params = request.sampling_params
        self.owners[slot] = state
        self.constants[slot] = np.frombuffer(params.sampler_constants, SAMPLER_CONSTANTS)[0]
        self.prompt_lens[slot] = request.num_prompt_tokens
        self.needs_row[slot] = not state.plain_sampling
        self.seeds[slot] = state.seed if state.plain_sampling else 0

    def _grow(self, num_slots: int) -> None:
        old = len(self.owners)
        for name in ("constants", "seeds", "prompt_lens", "needs_row"):
            column = getattr(self, name)
            grown = np.zeros(num_slots, column.dtype)
            grown[:old] = column
            setattr(self, name, grown)
        self.owners += [None] * (num_slots - old)


_IDLE_CONSTANTS = np.frombuffer(IDLE_ROW.params.sampler_constants, SAMPLER_CONSTANTS)[0]
_TABLE_ROW = operator.attrgetter("table_row")
_SAMPLES = operator.attrgetter("samples")
_FINISHED = operator.attrgetter("finished")
_START = operator.attrgetter("start_position")
_TOKEN_IDS = operator.attrgetter("token_ids")
