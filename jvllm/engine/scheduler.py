"""Scheduler: which requests run in the next step, and how many tokens each.

Owns the waiting queue and the running list, the per-step token budget
(`max_num_batched_tokens`) and sequence limit (`max_num_seqs`), chunked prefill,
preemption by recompute, the admission of n > 1 siblings by forking their source's KV
blocks, the beams of a beam search (a unit: scheduled, admitted and preempted together;
`replace_beams` forks the chosen beams' blocks), and the "static" policy used as a
baseline. Block accounting is delegated to the KV cache manager; stop conditions,
detokenization and outputs belong to the LLM engine.

Protocol: `schedule()`, dispatch the step, `update_from_output()` once its sampled
tokens are known. Overlapped (async) scheduling calls `schedule()` once more before
committing the previous step, so at most two steps are outstanding: a request whose
last token is still on the device holds an output placeholder, and its next row (one
decode token) names the row of the previous step whose sampled token it feeds back
(`prev_step_row`), resolved on the device. `num_computed_tokens` advances when a step
is scheduled. The engine checks stop conditions and calls `finish_request()` itself.

Speculative decoding: a decode row carries the request's draft tokens
(`Request.spec_token_ids`, set by the engine's proposer) after its input token, as
lookahead slots within the token budget (fewer, or none, when the budget or the free
blocks run short). Committing the row appends the tokens the target kept and rolls
`num_computed_tokens` back over the rejected drafts: their K/V slots are rewritten by
later steps and never enter the prefix cache, which registers only known tokens.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from jvllm.config import CacheConfig, SchedulerConfig
from jvllm.engine.kv_cache_manager import KVCacheManager, cdiv
from jvllm.engine.request import Request, RequestStatus

if TYPE_CHECKING:
    import numpy as np

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


# A ScheduledRequest from a tuple of all its fields, without the Python-level __new__ a
# NamedTuple's constructor runs (built per row and step).
_new_row = functools.partial(tuple.__new__, ScheduledRequest)


@dataclass(frozen=True)
class SchedulerOutput:
    step_id: int  # consecutive; update_from_output() commits steps in this order
    scheduled: list[ScheduledRequest]  # running requests first, then newly admitted ones
    blocks_to_copy: list[tuple[int, int]]  # (src, dst), applied before this step's forward
    preempted_request_ids: list[str]
    num_scheduled_tokens: int
    # Applied before the copies and the forward, swap-outs first.
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device)
    # Every row's block table as row `table_row` of this int32 array (zero past each
    # table's end); valid until the next schedule().
    block_tables: np.ndarray | None = None


class SchedulerStats(NamedTuple):
    num_running: int
    num_waiting: int  # including preempted requests
    num_free_blocks: int  # of the usable blocks (the null block is not counted)
    num_total_blocks: int  # usable blocks: num_blocks - 1
    kv_cache_usage_perc: float  # 0..1, usable blocks held by some request
    prefix_cache_queries: int  # tokens, cumulative
    prefix_cache_hits: int  # tokens, cumulative
    num_preemptions: int  # cumulative
    num_live_tokens: int  # running requests' computed tokens, dispatched steps included
    num_allocated_slots: int  # held blocks * block_size
    num_swapped: int  # requests whose blocks are in host memory
    num_swapped_out_blocks: int  # cumulative device -> host block copies
    num_swapped_in_blocks: int  # cumulative host -> device block copies
    num_recomputed_tokens: int  # cumulative computed tokens dropped by recompute preemption
    num_host_blocks: int  # the host pool's size (0 without swap)
    num_free_host_blocks: int
    prefix_cache_host_hits: int  # tokens, cumulative; of prefix_cache_hits, from the host tier
    num_offloaded_blocks: int  # cumulative evicted cached blocks copied to the host tier
    num_onloaded_blocks: int  # cumulative host-tier hits copied back
    num_tier_blocks: int  # the host tier's size
    num_used_tier_blocks: int


@dataclass
class _Step:
    """What one `schedule()` call has decided so far."""

    budget: int
    rows: list[ScheduledRequest] = field(default_factory=list)
    # Request id -> its computed tokens before this step (its row's start position).
    starts: dict[str, int] = field(default_factory=dict)
    # Request id -> its row, for the rows that sample.
    sampling_rows: dict[str, int] = field(default_factory=dict)
    preempted_ids: list[str] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        num_host_blocks: int = 0,
        num_tier_blocks: int = 0,
        num_lookahead_tokens: int = 0,
    ) -> None:
        """`num_host_blocks` host blocks for swapping (with preemption_mode="swap") and
        `num_tier_blocks` more for the prefix cache's host tier; every allocation covers
        `num_lookahead_tokens` more positions (a draft model's proposals)."""
        check_kv_capacity(scheduler_config, cache_config, num_blocks)
        self.scheduler_config = scheduler_config
        self.block_size = cache_config.block_size
        self.is_static = scheduler_config.scheduling_policy == "static"
        self.swaps = scheduler_config.preemption_mode == "swap" and num_host_blocks > 0
        self.kv_cache_manager = KVCacheManager(
            num_blocks,
            cache_config.block_size,
            cache_config.enable_prefix_caching,
            num_host_blocks if self.swaps else 0,
            num_tier_blocks,
            num_lookahead_tokens,
            scheduler_config.max_model_len,
        )
        self.waiting: deque[Request] = deque()  # FIFO; preempted requests go to the front
        # Swapped out, oldest first; they come back before any waiting request is admitted.
        self.swapped: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the tail is preempted first
        self._requests: dict[str, Request] = {}  # every unfinished request
        self._num_beams = 0  # of those, beams of beam searches
        self._pending_steps: deque[int] = deque()  # step ids scheduled, not yet committed
        self._next_step_id = 0
        # Request id -> its row in the latest step, for rows that sample.
        self._sampling_rows: dict[str, int] = {}
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
        self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        assert len(self._pending_steps) <= 1, "commit the step before the last one first"
        step = _Step(budget=self.scheduler_config.max_num_batched_tokens)
        self._schedule_running(step)
        # A step that had to preempt has no blocks to spare for newcomers.
        if not step.preempted_ids and not (self.is_static and self.running):
            self._schedule_swapped(step)
            if not self.swapped:
                self._schedule_waiting(step)
        offloads, onloads = self.kv_cache_manager.take_host_copies()
        self._sampling_rows = step.sampling_rows
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
        compute it); one finished since then is gone and its row is ignored.
        """
        assert self._pending_steps.popleft() == output.step_id, "steps commit in order"
        assert len(sampled) >= len(output.scheduled), (len(sampled), len(output.scheduled))
        kv, block_size, requests = self.kv_cache_manager, self.block_size, self._requests
        for row, token in zip(output.scheduled, sampled, strict=False):
            if not row.samples:
                continue
            request = requests.get(row.request_id)
            if request is None:
                continue
            assert request.num_output_placeholders > 0, (request, row)
            request.num_output_placeholders -= 1
            if request.beam_group is not None:
                # Its group picks the next token from the row's candidates (replace_beams).
                request.awaiting_selection = request.status is RequestStatus.RUNNING
                continue
            if row.num_spec_tokens:
                assert verified is not None, row
                tokens = verified[row.request_id]
                assert 1 <= len(tokens) <= row.num_spec_tokens + 1, (row, tokens)
                request.output_token_ids += tokens
                if request.status is RequestStatus.RUNNING:
                    # The rejected drafts' K/V count no more; later steps overwrite it.
                    request.num_computed_tokens -= row.num_spec_tokens + 1 - len(tokens)
            else:
                outputs = request.output_token_ids
                outputs.append(token)
                # One more known token completes a block only at a block boundary.
                if (len(request.prompt_token_ids) + len(outputs)) % block_size:
                    continue
            if request.status is RequestStatus.RUNNING:
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
        kv = self.kv_cache_manager
        pool = kv.block_pool
        live = sum(r.num_computed_tokens for r in self.running)
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_free_blocks=pool.num_free_blocks,
            num_total_blocks=pool.num_usable_blocks,
            kv_cache_usage_perc=kv.num_allocated_blocks / pool.num_usable_blocks,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=self._num_preemptions,
            num_live_tokens=live,
            num_allocated_slots=kv.num_allocated_blocks * self.block_size,
            num_swapped=len(self.swapped),
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

    def _schedule_running(self, step: _Step) -> None:
        running, kv, rows = self.running, self.kv_cache_manager, step.rows
        previous_rows, table_rows = self._sampling_rows, kv.table_array.row_of
        tables, sampling_rows, starts = kv.block_tables, step.sampling_rows, step.starts
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
            # The common case, a unit of one: no lists, and the lengths read once (this
            # loop runs for every running request every step).
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
                    # The overlapped decode row (most rows of most steps): its one token
                    # is the one the previous step samples, still on the device.
                    if not (
                        kv.allocate_slot(request) or self._allocate(step, request, 1, [request])
                    ):
                        return
                    request_id = request.request_id
                    sampling_rows[request_id] = len(rows)
                    rows.append(
                        _new_row(
                            (
                                request_id,
                                [PLACEHOLDER_TOKEN],
                                computed,
                                tables[request_id],
                                True,
                                previous_rows[request_id],
                                0,
                                table_rows[request_id],
                            )
                        )
                    )
                    starts[request_id] = computed
                    step.budget -= 1
                    request.num_output_placeholders = 2
                    request.num_computed_tokens = computed + 1
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

    def _schedule_unit(self, step: _Step, unit: list[Request], todo: list[Request]) -> bool:
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

    def _allocate(self, step: _Step, request: Request, num_new: int, unit: list[Request]) -> bool:
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

    def _schedule_waiting(self, step: _Step) -> None:
        """Admit waiting requests in FIFO order while budget, sequences and blocks allow;
        the beams of a group (preempted together) are admitted together."""
        skipped: list[Request] = []
        # Sequences a beam search that has not forked yet will add to its one.
        unforked = 0
        if self._num_beams:
            unforked = sum(r.beam_width - 1 for r in self.running if _is_unforked_beam(r))
        free_seats = self.scheduler_config.max_num_seqs - len(self.running) - unforked
        while self.waiting and step.budget > 0:
            unit = [self.waiting.popleft()]
            while (
                self.waiting
                and unit[0].beam_group is not None
                and (self.waiting[0].beam_group == unit[0].beam_group)
            ):
                unit.append(self.waiting.popleft())
            if any(r.num_output_placeholders for r in unit) or self._must_wait_for_source(
                unit[0], step
            ):
                skipped += unit  # does not hold up the requests behind it
                continue
            seats = unit[0].beam_width if _is_unforked_beam(unit[0]) else len(unit)
            if seats > free_seats or not self._admit_unit(step, unit):
                self.waiting.extendleft(reversed(unit))
                break
            free_seats -= seats
        self.waiting.extendleft(reversed(skipped))

    def _must_wait_for_source(self, request: Request, step: _Step) -> bool:
        """Whether a fork child waits for its source to compute the shared prompt; before
        this step, since copy-on-write copies run before the step's forward."""
        if request.fork_source is None:
            return False
        source = self._requests.get(request.fork_source)
        if self.is_static or source is None or source.status is RequestStatus.PREEMPTED:
            request.fork_source = None  # nothing to share: prefill like any request
            return False
        assert source.prompt_token_ids == request.prompt_token_ids, (source, request)
        computed = step.starts.get(source.request_id, source.num_computed_tokens)
        return source.status is not RequestStatus.RUNNING or (
            computed < request.num_prompt_tokens - 1
        )

    def _admit_unit(self, step: _Step, unit: list[Request]) -> bool:
        """Take blocks for every request of the unit and schedule their first chunks; False,
        changing nothing, if the budget or the blocks do not suffice for all of them."""
        if len(unit) > step.budget:
            return False
        sizes, budget = [], step.budget
        for i, request in enumerate(unit):
            num_new = self._take_blocks(request, budget - (len(unit) - 1 - i))
            if num_new is None:
                for taken in unit[:i]:
                    self.kv_cache_manager.drop_unwritten(taken)
                    self.kv_cache_manager.free(taken.request_id)
                    taken.num_computed_tokens = 0
                return False
            sizes.append(num_new)
            budget -= num_new
        for request, num_new in zip(unit, sizes, strict=True):
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._add_row(step, request, num_new)
        return True

    def _take_blocks(self, request: Request, budget: int) -> int | None:
        """Take blocks for a waiting request's first chunk of at most `budget` tokens and
        set its computed tokens to what it shares; the chunk's size, or None (nothing
        taken) when the free blocks do not suffice."""
        kv = self.kv_cache_manager
        if request.fork_source is not None:
            # Share the whole prompt but its last token, which the child runs to sample.
            num_shared = request.num_prompt_tokens - 1
            kv.fork(request.fork_source, request.request_id, num_shared)
            request.num_computed_tokens = num_shared
            num_new = min(request.num_tokens - num_shared, budget)
            if not kv.allocate_slots(request, num_new):
                kv.free(request.request_id)
                request.num_computed_tokens = 0
                return None
        else:
            prefix = kv.find_cached_prefix(request)
            num_shared = prefix.num_tokens
            num_new = min(request.num_tokens - num_shared, budget)
            # The static baseline reserves a whole max_model_len sequence up front.
            reserve = self.scheduler_config.max_model_len if self.is_static else 0
            if not kv.allocate_slots(request, num_new, prefix, reserve):
                return None
            request.num_computed_tokens = num_shared
        if request.num_cached_tokens is None:
            request.num_cached_tokens = num_shared
        return num_new

    def _preempt(self, step: _Step, request: Request) -> None:
        """Preempt by swap (its computed blocks go to host memory) when the host pool has
        room and the request is not a beam, else by recompute (all its K/V dropped)."""
        assert not self.is_static, "the static policy reserves blocks and never preempts"
        kv = self.kv_cache_manager
        request.num_preemptions += 1
        self._num_preemptions += 1
        request.awaiting_selection = False  # a beam's candidates are dropped: it proposes again
        if self.swaps and request.beam_group is None and kv.can_swap_out(request):
            pairs = kv.swap_out(request)
            step.swap_out += pairs
            self._num_swapped_out_blocks += len(pairs)
            request.status = RequestStatus.SWAPPED
            self.swapped.appendleft(request)
            return
        # A request of the unit being scheduled may hold blocks this step never writes.
        kv.drop_unwritten(request)
        kv.free(request.request_id)
        self._num_recomputed_tokens += request.num_computed_tokens
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        self.waiting.appendleft(request)

    def _schedule_swapped(self, step: _Step) -> None:
        """Swap requests back in, oldest first, while sequences, budget and blocks allow;
        each runs this step (its blocks are copied in before the forward)."""
        kv = self.kv_cache_manager
        while self.swapped and step.budget > 0:
            request = self.swapped[0]
            if request.num_output_placeholders or (
                len(self.running) >= self.scheduler_config.max_num_seqs
            ):
                return  # its last token is still on the device, or no seat is free
            num_new = min(
                request.num_tokens_with_placeholders - request.num_computed_tokens, step.budget
            )
            # Room for its blocks and for its next tokens' (all its blocks come back
            # private), lookahead slots included.
            end = request.num_computed_tokens + num_new
            end = min(end + kv.num_lookahead_tokens, self.scheduler_config.max_model_len)
            spare = cdiv(end, self.block_size) - cdiv(request.num_computed_tokens, self.block_size)
            pairs = kv.swap_in(request, spare)
            if pairs is None:
                return
            self.swapped.popleft()
            step.swap_in += pairs
            self._num_swapped_in_blocks += len(pairs)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            fits = kv.allocate_slots(request, num_new)  # swap_in left room for it
            assert fits, request
            self._add_row(step, request, num_new)

    def _add_row(
        self, step: _Step, request: Request, num_new: int, drafts: list[int] | None = None
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
            prev_step_row = self._sampling_rows[request_id]
        else:
            token_ids = request.get_token_ids(start, end)
        samples = end == num_tokens + placeholders
        num_spec = 0
        if request.spec_token_ids:
            request.spec_token_ids = []  # proposed for this row only
        if drafts:
            num_spec = len(drafts)
            token_ids = token_ids + drafts
        rows = step.rows
        if samples:
            step.sampling_rows[request_id] = len(rows)
            request.num_output_placeholders = placeholders + 1
        kv = self.kv_cache_manager
        rows.append(
            ScheduledRequest(
                request_id,
                token_ids,
                start,
                kv.block_tables[request_id],
                samples,
                prev_step_row,
                num_spec,
                kv.table_array.row(request_id),
            )
        )
        step.starts[request_id] = start
        step.budget -= num_new + num_spec
        request.num_computed_tokens = end + num_spec


def check_kv_capacity(
    scheduler_config: SchedulerConfig, cache_config: CacheConfig, num_blocks: int
) -> None:
    """Raises when `num_blocks` KV blocks (one reserved) cannot hold one sequence of
    max_model_len tokens."""
    blocks_per_seq = cdiv(scheduler_config.max_model_len, cache_config.block_size)
    if num_blocks - 1 < blocks_per_seq:
        raise ValueError(
            f"num_blocks={num_blocks} (one reserved) cannot hold one sequence of "
            f"max_model_len={scheduler_config.max_model_len} tokens, which needs "
            f"{blocks_per_seq + 1} blocks of block_size={cache_config.block_size}; "
            "lower max_model_len or give the KV cache more memory "
            "(gpu_memory_utilization, num_gpu_blocks_override)"
        )


def _is_unforked_beam(request: Request) -> bool:
    """The one request of a beam search before its first selection."""
    return request.beam_group is not None and not request.output_token_ids
