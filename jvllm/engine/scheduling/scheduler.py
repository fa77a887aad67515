"""Scheduler: which requests run in the next step, and how many tokens each.

Owns the waiting queue and the running list, the per-step token budget
(`max_num_batched_tokens`) and sequence limit (`max_num_seqs`), chunked prefill,
preemption by recompute, the admission of n > 1 siblings by forking their source's KV
blocks, the beams of a beam search (a unit: scheduled, admitted and preempted together;
`replace_beams` forks the chosen beams' blocks), and the "static" policy used as a
baseline. Admitting waiting and swapped requests and preempting are `admission.py`'s,
the running requests' rows `rows.py`'s (both mixed in); block accounting is the KV cache
manager's; stop conditions, detokenization and outputs are the output processor's.

Protocol: `schedule()`, dispatch the step, `update_from_output()` once its sampled
tokens are known. Overlapped (async) scheduling calls `schedule()` once more before
committing the previous step, so at most two steps are outstanding: a request whose
last token is still on the device holds an output placeholder, and its next row (one
decode token) names the row of the previous step whose sampled token it feeds back
(`prev_step_row`), resolved on the device. `num_computed_tokens` advances when a step
is scheduled. The engine calls `finish_request()` for what the output processor ended.

Speculative decoding: a decode row carries the request's draft tokens
(`Request.spec_token_ids`, set by the engine's proposer) after its input token, as
lookahead slots within the token budget (fewer, or none, when the budget or the free
blocks run short). Committing the row appends the tokens the target kept and rolls
`num_computed_tokens` back over the rejected drafts: their K/V slots are rewritten by
later steps and never enter the prefix cache, which registers only known tokens.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np

from jvllm.config import CacheConfig, SchedulerConfig
from jvllm.engine.kv.hybrid_kv_cache_manager import new_kv_cache_manager
from jvllm.engine.kv.kv_cache_manager import cdiv
from jvllm.engine.metrics import SchedulerStats
from jvllm.engine.request import Request, RequestStatus
from jvllm.engine.scheduling.admission import Admission, ScheduleStep
from jvllm.engine.scheduling.rows import RunningRows
from jvllm.engine.step_io import SchedulerOutput, StepRows


class Scheduler(Admission, RunningRows):
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        num_host_blocks: int = 0,
        num_tier_blocks: int = 0,
        num_lookahead_tokens: int = 0,
        sliding_window: int | None = None,
    ) -> None:
        """`num_host_blocks` host blocks for swapping (preemption_mode="swap"), `num_tier_blocks`
        more for the prefix cache's host tier; allocations cover `num_lookahead_tokens` more
        positions (a draft's proposals); `sliding_window`: see `new_kv_cache_manager`."""
        check_kv_capacity(scheduler_config, cache_config, num_blocks)
        self.scheduler_config = scheduler_config
        self.block_size = cache_config.block_size
        self.is_static = scheduler_config.scheduling_policy == "static"
        self.by_priority = scheduler_config.scheduling_policy == "priority"
        self.swaps = scheduler_config.preemption_mode == "swap" and num_host_blocks > 0
        self.kv_cache_manager = new_kv_cache_manager(
            cache_config,
            scheduler_config.max_model_len,
            num_blocks,
            num_host_blocks if self.swaps else 0,
            num_tier_blocks,
            num_lookahead_tokens,
            sliding_window,
        )
        self.waiting: deque[Request] = deque()  # preempted requests go to the front
        # Swapped out, oldest first; they come back before any waiting request is admitted.
        self.swapped: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the tail is preempted first
        self._requests: dict[str, Request] = {}  # every unfinished request
        self._num_beams = 0  # of those, beams of beam searches
        self._pending_steps: deque[int] = deque()  # step ids scheduled, not yet committed
        self._next_step_id = 0
        # [table rows] int64: each block-table row's sampling row in the latest step
        # (-1: none), for the next step's rows that feed back its samples.
        self._previous_rows = np.full(1, -1, np.int64)
        self._num_preemptions = 0
        self._num_swapped_out_blocks = 0
        self._num_swapped_in_blocks = 0
        self._num_recomputed_tokens = 0

    def add_request(self, request: Request) -> None:
        """Queues a request the engine has validated (`jvllm.engine.validation`)."""
        assert request.request_id not in self._requests, request
        assert 0 < request.num_tokens <= self.scheduler_config.max_model_len, request
        assert request.status is RequestStatus.WAITING, request
        self._requests[request.request_id] = request
        self._set_length_limit(request)
        self._num_beams += request.beam_group is not None
        self._join(self.waiting, request)

    def schedule(self) -> SchedulerOutput:
        assert len(self._pending_steps) <= 1, "commit the step before the last one first"
        kv = self.kv_cache_manager
        step = ScheduleStep(self.scheduler_config.max_num_batched_tokens, StepRows(kv.block_tables))
        self._schedule_running(step)
        # A step that had to preempt has no blocks to spare for newcomers.
        if not step.preempted_ids and not (self.is_static and self.running):
            self._schedule_swapped(step)
            if not self.swapped:
                self._schedule_waiting(step)
        offloads, onloads = self.kv_cache_manager.take_host_copies()
        self._previous_rows = self._seal(step.rows)
        step_id, self._next_step_id = self._next_step_id, self._next_step_id + 1
        self._pending_steps.append(step_id)
        return SchedulerOutput(
            step_id=step_id,
            scheduled=step.rows,
            blocks_to_copy=self.kv_cache_manager.take_blocks_to_copy(),
            preempted_request_ids=step.preempted_ids,
            num_scheduled_tokens=self.scheduler_config.max_num_batched_tokens - step.budget,
            blocks_to_swap_out=step.swap_out + offloads,
            blocks_to_swap_in=step.swap_in + onloads,
            block_tables=self.kv_cache_manager.table_array.array,
        )

    def _seal(self, rows: StepRows) -> np.ndarray:
        """Takes the step's columns (its steady rows' previous rows from the last step's
        map); returns this step's map: each table row's sampling row (-1: none)."""
        num_table_rows = len(self.kv_cache_manager.table_array.array)
        previous = self._previous_rows  # [table rows then]
        if len(previous) < num_table_rows:  # the table array grew: new rows had no row
            missing = np.full(num_table_rows - len(previous), -1, np.int64)
            previous = np.concatenate([previous, missing])
        columns = rows.seal(previous)
        latest = np.full(num_table_rows, -1, np.int64)  # [table rows]
        sampling = np.flatnonzero(columns.samples & (columns.table_rows >= 0))
        latest[columns.table_rows[sampling]] = sampling
        return latest

    def update_from_output(
        self,
        output: SchedulerOutput,
        sampled: Sequence[int],
        verified: dict[str, list[int]] | None = None,
    ) -> None:
        """Commit a step: the sampled tokens replace their placeholders, `sampled[i]`
        that of row i (read for the rows that sample; it may run past the rows). A row
        with draft tokens gives `verified[request_id]` instead: the drafts the target
        kept, then the token it sampled after them.

        A request preempted since the step was scheduled keeps its token (the step did
        compute it); one finished since then is gone and its row is ignored. Steady
        decode rows (`StepRows`' columns) are read as their requests alone.
        """
        assert self._pending_steps.popleft() == output.step_id, "steps commit in order"
        rows = output.scheduled
        assert isinstance(rows, StepRows), type(rows)
        assert len(sampled) >= len(rows), (len(sampled), len(rows))
        kv, block_size, whole = self.kv_cache_manager, self.block_size, rows.whole
        running = RequestStatus.RUNNING
        for i, request in enumerate(rows.requests):  # (indexing: no tuple per row, as zip's)
            token = sampled[i]
            row = whole.get(i) if whole else None  # None: a steady decode row
            status = request.status
            if status is not running and status.is_finished:
                continue  # finished since the step was scheduled: its row is dropped
            if row is None:  # one token, sampled: the placeholder becomes it
                request.num_output_placeholders -= 1
                outputs = request.output_token_ids
                outputs.append(token)
                # One more known token completes a block only at a block boundary.
                known = len(request.prompt_token_ids) + len(outputs)
                if known % block_size == 0 and status is running:
                    kv.cache_full_blocks(request)
                continue
            if not row.samples:
                continue
            assert request.num_output_placeholders > 0, (request, row)
            request.num_output_placeholders -= 1
            if request.beam_group is not None:
                # Its group picks the next token from the row's candidates (replace_beams).
                request.awaiting_selection = status is running
                continue
            if row.num_spec_tokens:
                assert verified is not None, row
                tokens = verified[row.request_id]
                assert 1 <= len(tokens) <= row.num_spec_tokens + 1, (row, tokens)
                request.output_token_ids += tokens
                if status is running:
                    # The rejected drafts' K/V count no more; later steps overwrite it.
                    request.num_computed_tokens -= row.num_spec_tokens + 1 - len(tokens)
            else:
                request.output_token_ids.append(token)
            if status is running:
                kv.cache_full_blocks(request)  # blocks completed by a now-known token

    def replace_beams(
        self, parents: list[Request], children: list[tuple[Request, Request]]
    ) -> None:
        """A beam group's selection: each (child, parent) pair continues the parent with
        one more token and shares the parent's computed K/V blocks (copy-on-write when it
        writes into a shared one); then the parents go. Every parent is running and
        awaiting selection; the children take the parents' place in `running`."""
        kv = self.kv_cache_manager
        position = min(self.running.index(p) for p in parents)
        for child, parent in children:
            assert parent.awaiting_selection and parent.status is RequestStatus.RUNNING, parent
            assert child.num_tokens == parent.num_computed_tokens + 1, (child, parent)
            kv.fork(parent.request_id, child.request_id, parent.num_computed_tokens)
            child.num_computed_tokens = parent.num_computed_tokens
            child.num_cached_tokens = parent.num_cached_tokens
            child.status = RequestStatus.RUNNING
            self._requests[child.request_id] = child
            self._set_length_limit(child)
            self._num_beams += 1
        for parent in parents:
            self.finish_request(parent.request_id, RequestStatus.FINISHED_STOPPED)
        self.running[position:position] = [child for child, _ in children]

    def finish_request(self, request_id: str, status: RequestStatus) -> None:
        """Finish a waiting, running or preempted request and free its blocks now.

        The scheduler forgets the request: unknown or already finished ids are ignored.
        """
        assert status.is_finished, status
        request = self._requests.pop(request_id, None)
        if request is None:
            return
        self._num_beams -= request.beam_group is not None
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.SWAPPED:
            self.swapped.remove(request)
        else:
            self.waiting.remove(request)
        self.kv_cache_manager.free(request_id)
        request.status = status

    def stats(self) -> SchedulerStats:
        kv, pool = self.kv_cache_manager, self.kv_cache_manager.block_pool
        live = sum(r.num_computed_tokens for r in self.running)
        return SchedulerStats(
            num_requests_running=len(self.running),
            num_requests_waiting=len(self.waiting),
            num_free_blocks=pool.num_free_blocks,
            num_total_blocks=pool.num_usable_blocks,
            kv_cache_usage_perc=kv.num_allocated_blocks / pool.num_usable_blocks,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=self._num_preemptions,
            num_live_tokens=live,
            num_allocated_slots=kv.num_allocated_blocks * self.block_size,
            num_requests_swapped=len(self.swapped),
            num_swapped_out_blocks=self._num_swapped_out_blocks,
            num_swapped_in_blocks=self._num_swapped_in_blocks,
            num_recomputed_tokens=self._num_recomputed_tokens,
            num_host_blocks=kv.host_pool.num_usable_blocks if kv.host_pool else 0,
            num_free_host_blocks=kv.host_pool.num_free_blocks if kv.host_pool else 0,
            prefix_cache_host_hits=kv.prefix_cache_host_hits,
            num_offloaded_blocks=kv.num_offloaded_blocks,
            num_onloaded_blocks=kv.num_onloaded_blocks,
            num_tier_blocks=kv.host_tier.num_blocks if kv.host_tier else 0,
            num_used_tier_blocks=kv.host_tier.num_used_blocks if kv.host_tier else 0,
        )

    def _schedule_unit(self, step: ScheduleStep, unit: list[Request], todo: list[Request]) -> bool:
        """Schedules `todo` (the unit's requests with work) all together or not at all;
        False when the unit itself was preempted, so nothing behind it fits either."""
        if len(todo) > step.budget:
            return True  # the beams of a group run in one step: wait for a fresh budget
        sizes, budget = [], step.budget
        for i, request in enumerate(todo):
            # Every request after this one keeps at least one token of the budget.
            num_new = min(
                request.num_tokens_with_placeholders - request.num_computed_tokens,
                budget - (len(todo) - 1 - i),
            )
            sizes.append(num_new)
            budget -= num_new
        for request, num_new in zip(todo, sizes, strict=True):
            if not self._allocate(step, request, num_new, unit):
                return False
        for request, num_new in zip(todo, sizes, strict=True):
            self._add_row(step, request, num_new)
        return True

    def _allocate(
        self, step: ScheduleStep, request: Request, num_new: int, unit: list[Request]
    ) -> bool:
        """Slots for the request's next `num_new` tokens, preempting from the tail until
        they fit; False when that preempted the request's own unit."""
        assert num_new > 0, f"{request} has nothing to compute"
        while not self.kv_cache_manager.allocate_slots(request, num_new):
            # Preempt the most recently admitted unit that is not scheduled yet:
            # everything before this unit is scheduled, so the tail is always eligible.
            victims = self._pop_tail_unit()
            for victim in reversed(victims):  # so the unit keeps its order in waiting
                self._preempt(step, victim)
            step.preempted_ids += [v.request_id for v in victims]
            if unit[0] in victims:
                return False
        return True

    def _unit_at(self, index: int) -> list[Request]:
        """The running request at `index`, or with the beams of its group that follow it."""
        first = self.running[index]
        end = index + 1
        if first.beam_group is not None:
            while end < len(self.running) and self.running[end].beam_group == first.beam_group:
                end += 1
        return self.running[index:end]

    def _pop_tail_unit(self) -> list[Request]:
        """Removes the last running request from `running`, with its beam group's run."""
        start = len(self.running) - 1
        group = self.running[start].beam_group
        if group is not None:
            while start > 0 and self.running[start - 1].beam_group == group:
                start -= 1
        unit, self.running[start:] = self.running[start:], []
        return unit

    def _reaches_length_limit(self, request: Request) -> bool:
        """Whether the tokens already sampled (some still on the device) end the request
        by length, so scheduling it again would only compute a token to throw away."""
        if not request.num_output_placeholders:
            return False  # every token is known: the engine has checked it
        return request.num_tokens_with_placeholders >= request.max_num_tokens

    def _set_length_limit(self, request: Request) -> None:
        """`request.max_num_tokens`: the token count that ends it by length (max_tokens
        outputs, or max_model_len), compared once per row and step."""
        limit = self.scheduler_config.max_model_len
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            limit = min(limit, len(request.prompt_token_ids) + max_tokens)
        request.max_num_tokens = limit


def check_kv_capacity(
    scheduler_config: SchedulerConfig, cache_config: CacheConfig, num_blocks: int
) -> None:
    """Raises when `num_blocks` KV blocks (one reserved) cannot hold a max_model_len sequence."""
    blocks_per_seq = cdiv(scheduler_config.max_model_len, cache_config.block_size)
    if num_blocks - 1 < blocks_per_seq:
        raise ValueError(
            f"num_blocks={num_blocks} (one reserved) cannot hold one sequence of "
            f"max_model_len={scheduler_config.max_model_len} tokens, which needs "
            f"{blocks_per_seq + 1} blocks of block_size={cache_config.block_size}; "
            "lower max_model_len or give the KV cache more memory "
            "(gpu_memory_utilization, num_gpu_blocks_override)"
        )
