"""The running requests' rows of a step: decode rows, their draft tokens and placeholders.

Owns `_schedule_running` (one row per running request, in order, until the token budget
or the free blocks run out: the steady decode row whose token is still on the device,
kept as columns of `StepRows`; prompt chunks, and decode rows carrying speculative
draft tokens as lookahead slots), `_lookahead` (how many drafts a row verifies) and
`_add_row` (one `ScheduledRequest`, the request's counters advanced). `Scheduler`
mixes this in; preemption and admission are `admission.py`'s, the step protocol and
committing sampled tokens `scheduler.py`'s.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from jvllm.config import SchedulerConfig
from jvllm.engine.kv.kv_cache_manager import KVCacheManager
from jvllm.engine.request import Request
from jvllm.engine.scheduling.admission import ScheduleStep
from jvllm.engine.step_io import PLACEHOLDER_TOKEN, ScheduledRequest


class RunningRows:
    """The row-building half of `Scheduler` (whose `__init__` sets these attributes)."""

    scheduler_config: SchedulerConfig
    kv_cache_manager: KVCacheManager
    running: list[Request]
    # [table rows] int64: each block-table row's sampling row in the previous step
    # (-1: none), for `prev_step_row` (`Scheduler.schedule` renews it every step).
    _previous_rows: np.ndarray
    _unit_at: Callable[[int], list[Request]]
    _reaches_length_limit: Callable[[Request], bool]
    _schedule_unit: Callable[[ScheduleStep, list[Request], list[Request]], bool]
    _allocate: Callable[[ScheduleStep, Request, int, list[Request]], bool]

    def _schedule_running(self, step: ScheduleStep) -> None:
        running, kv, rows = self.running, self.kv_cache_manager, step.rows
        table_rows = kv.table_array.row_of
        # A steady decode row is three columns of `StepRows`, no `ScheduledRequest`; its
        # previous row comes from `_previous_rows` when the rows are sealed.
        add_request, add_start = rows.requests.append, rows.starts.append
        add_table_row = rows.table_rows.append
        index = 0
        while index < len(running) and step.budget > 0:
            request = running[index]
            if request.beam_group is not None:
                unit = self._unit_at(index)
                # A beam waits for its group's selection.
                todo = [
                    r for r in unit if not (r.waits_for_selection or self._reaches_length_limit(r))
                ]
                if todo and not self._schedule_unit(step, unit, todo):
                    return
                index += len(unit)
                continue
            # The common case, a unit of one: no lists, the lengths read once (every step).
            index += 1
            placeholders = request.num_output_placeholders
            num_tokens = (
                len(request.prompt_token_ids) + len(request.output_token_ids) + placeholders
            )
            computed = request.num_computed_tokens
            if placeholders:
                # Its sampled tokens may end it by length: it finishes when the last
                # placeholder is committed.
                if num_tokens >= request.max_num_tokens:
                    continue
                if placeholders == 1 and computed + 1 == num_tokens and not request.spec_token_ids:
                    # The steady decode row (most rows of most steps): its one token
                    # is the one the previous step samples, still on the device. Its
                    # slot: one the KV cache manager granted, or asked for.
                    if room := request.kv_room:
                        request.kv_room = room - 1
                    elif not (
                        kv.allocate_slot(request) or self._allocate(step, request, 1, [request])
                    ):
                        return
                    # (No `step.starts` entry: only a fork source's is read, whose
                    # prompt is computed before and after this row.)
                    add_request(request)
                    add_start(computed)
                    add_table_row(table_rows[request.request_id])
                    step.budget -= 1
                    request.num_output_placeholders = 2
                    request.num_computed_tokens = computed + 1
                    continue
            elif num_tokens >= request.max_num_tokens and request.output_token_ids:
                # Its sampled tokens end it by length, the commit saying so still to come
                # (speculation's commit trails the next step's scheduling: spec_step.py).
                continue
            num_new = min(num_tokens - computed, step.budget)
            drafts = (
                self._lookahead(request, num_new, step.budget) if request.spec_token_ids else []
            )
            # Most rows fit at once (allocate_slots changes nothing when they do not).
            if not (
                drafts
                or kv.allocate_slots(request, num_new)
                or self._allocate(step, request, num_new, [request])
            ):
                return
            self._add_row(step, request, num_new, drafts)

    def _lookahead(self, request: Request, num_new: int, budget: int) -> list[int]:
        """The draft tokens a decode row verifies this step, with their slots allocated:
        as many as the budget leaves room for; none when the blocks do not suffice."""
        drafts = request.spec_token_ids[: budget - 1]
        if not drafts:
            return []
        # A prompt chunk, or a token still on the device, has nothing to verify.
        fits = (
            num_new == 1
            and request.num_tokens - request.num_computed_tokens == 1
            and self.kv_cache_manager.allocate_slots(request, 1 + len(drafts))
        )
        return drafts if fits else []

    def _add_row(
        self, step: ScheduleStep, request: Request, num_new: int, drafts: list[int] | None = None
    ) -> None:
        """Schedules positions [computed, computed + num_new) and advances the request;
        `drafts` (allocated already) follow at the next positions."""
        request_id = request.request_id
        start = request.num_computed_tokens
        end = start + num_new
        assert end <= self.scheduler_config.max_model_len, (request, num_new)
        prev_step_row = None
        placeholders = request.num_output_placeholders
        num_tokens = len(request.prompt_token_ids) + len(request.output_token_ids)
        if end > num_tokens:
            # The one token of this row is still on the device: the previous step sampled it.
            assert num_new == 1 and placeholders == 1, request
            token_ids = [PLACEHOLDER_TOKEN]
            prev_step_row = int(
                self._previous_rows[self.kv_cache_manager.table_array.row(request_id)]
            )
            assert prev_step_row >= 0, request
        else:
            token_ids = request.get_token_ids(start, end)
        samples = end == num_tokens + placeholders
        num_spec = 0
        if request.spec_token_ids:
            request.spec_token_ids = []  # proposed for this row only
        if drafts:
            num_spec = len(drafts)
            token_ids = token_ids + drafts
        if samples:
            request.num_output_placeholders = placeholders + 1
        kv = self.kv_cache_manager
        row = ScheduledRequest(
            request_id,
            token_ids,
            start,
            kv.block_tables[request_id],
            samples,
            prev_step_row,
            num_spec,
            kv.table_array.row(request_id),
        )
        step.rows.add(row, request)
        step.starts[request_id] = start
        step.budget -= num_new + num_spec
        request.num_computed_tokens = end + num_spec
