"""Admission: waiting and swapped-out requests joining the running batch, and preemption.

Owns admission of waiting requests in queue order (fork children after their source has
computed the shared prompt; a beam search's beams as one unit), swapping requests back
in, preempting a running request (by swap where the host pool has room, else by
recompute), and the order of the three queues: arrival order, or with
scheduling_policy="priority" every queue sorted by (priority, arrival) so that the head
of `waiting` is admitted first and the tail of `running` (the lowest priority, newest)
is preempted first, as vLLM's priority policy chooses. `Scheduler` mixes this in; the
running requests' rows, the step protocol and the counters' reporting are
`scheduler.py`'s.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable, MutableSequence
from dataclasses import dataclass, field

from jvllm.config import SchedulerConfig
from jvllm.engine.kv.kv_cache_manager import KVCacheManager, cdiv
from jvllm.engine.request import Request, RequestStatus
from jvllm.engine.step_io import StepRows

# Steps of fewer tokens are not cut to a bucket: their cost is reading the weights, a few
# padded tokens more or less change little, and the cut would delay a first token.
MIN_ALIGNED_TOKENS = 64


@dataclass
class ScheduleStep:
    """What one `schedule()` call has decided so far."""

    budget: int
    rows: StepRows
    # Request id -> its computed tokens before this step (its row's start position), for
    # the rows that are not steady decode rows.
    starts: dict[str, int] = field(default_factory=dict)
    preempted_ids: list[str] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    # A first chunk was cut to end the step at the top of a token bucket: admitting more
    # would pad it again, so the step takes no more waiting requests.
    at_bucket_top: bool = False


class Admission:
    """The admitting half of `Scheduler` (whose `__init__` sets these attributes)."""

    scheduler_config: SchedulerConfig
    kv_cache_manager: KVCacheManager
    block_size: int
    is_static: bool
    by_priority: bool  # scheduling_policy="priority": queues sorted by priority_key
    swaps: bool  # preemption may swap (preemption_mode="swap" and a host pool)
    waiting: deque[Request]
    swapped: deque[Request]
    running: list[Request]
    _requests: dict[str, Request]
    _num_beams: int
    _num_preemptions: int
    _num_swapped_out_blocks: int
    _num_swapped_in_blocks: int
    _num_recomputed_tokens: int
    # Schedules a request's next `num_new` positions as a row of the step.
    _add_row: Callable[[ScheduleStep, Request, int], None]
    # The runner's token buckets (a step's tokens are padded up to the next one), set by
    # the engine; None: first chunks are never cut to fit one.
    token_buckets: tuple[int, ...] | None = None

    def _schedule_waiting(self, step: ScheduleStep) -> None:
        """Admit waiting requests in FIFO order while budget, sequences and blocks allow;
        the beams of a group (preempted together) are admitted together."""
        skipped: list[Request] = []
        # Sequences a beam search that has not forked yet will add to its one.
        unforked = 0
        if self._num_beams:
            unforked = sum(r.beam_width - 1 for r in self.running if is_unforked_beam(r))
        free_seats = self.scheduler_config.max_num_seqs - len(self.running) - unforked
        adapters = self._running_adapters()
        while self.waiting and step.budget > 0 and not step.at_bucket_top:
            unit = [self.waiting.popleft()]
            while (
                self.waiting
                and unit[0].beam_group is not None
                and (self.waiting[0].beam_group == unit[0].beam_group)
            ):
                unit.append(self.waiting.popleft())
            if (
                any(r.num_output_placeholders for r in unit)
                or self._must_wait_for_source(unit[0], step)
                or not self._adapter_fits(adapters, unit[0])
                or self._awaits_kv_read(unit[0])
            ):
                skipped += unit  # does not hold up the requests behind it
                continue
            seats = unit[0].beam_width if is_unforked_beam(unit[0]) else len(unit)
            if seats > free_seats or not self._admit_unit(step, unit):
                self.waiting.extendleft(reversed(unit))
                break
            free_seats -= seats
            if unit[0].lora_int_id:
                adapters.add(unit[0].lora_int_id)
        self.waiting.extendleft(reversed(skipped))

    def _running_adapters(self) -> set[int]:
        """The LoRA adapters the running requests use (empty without LoRA)."""
        if not self.scheduler_config.max_loras:
            return set()
        return {r.lora_int_id for r in self.running if r.lora_int_id}

    def _adapter_fits(self, adapters: set[int], request: Request) -> bool:
        """Whether `request` may run beside the running requests' `adapters`: at most
        max_loras distinct adapters run at once, so every step's fit in the device
        slots (vLLM's rule); a request whose adapter does not fit waits."""
        lora = request.lora_int_id
        limit = self.scheduler_config.max_loras
        return not lora or lora in adapters or len(adapters) < limit

    def _awaits_kv_read(self, request: Request) -> bool:
        """Whether the request waits for prefix blocks being read from the fs KV tier
        into the host tier (asked for here, the first time it is considered)."""
        kv = self.kv_cache_manager
        tier = kv.disk_tier
        if tier is None or request.lora_int_id or request.fork_source is not None:
            return False
        tier.refresh()
        waits = tier.still_waiting(request.request_id)
        if waits is not None:
            return waits
        prefix = kv.find_cached_prefix(request)
        if request.sampling_params.prompt_logprobs is not None:
            return False
        num_full = (request.num_tokens - 1) // self.block_size
        first = len(prefix.block_ids)
        keys = (kv.block_key(request, index) for index in range(first, num_full))
        return tier.read_ahead(request.request_id, prefix, keys)

    def _must_wait_for_source(self, request: Request, step: ScheduleStep) -> bool:
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

    def _admit_unit(self, step: ScheduleStep, unit: list[Request]) -> bool:
        """Take blocks for every request of the unit and schedule their first chunks; False,
        changing nothing, if the budget or the blocks do not suffice for all of them."""
        if len(unit) > step.budget:
            return False
        sizes, budget = [], step.budget
        for i, request in enumerate(unit):
            # A unit of one may be cut to a bucket's top (a beam group is admitted whole).
            aligns = step if len(unit) == 1 else None
            num_new = self._take_blocks(request, budget - (len(unit) - 1 - i), aligns)
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
            self._join(self.running, request)
            self._add_row(step, request, num_new)
        return True

    def _bucket_aligned(self, num_new: int, scheduled: int) -> int:
        """A first chunk of `num_new` prompt tokens, cut so that the step ends at the top of
        a token bucket when the tokens cut off are fewer than the padding they would cost
        (the runner pads a step up to its next bucket; the cut-off tokens run with the
        next step). E.g. 3 decode rows and a 128-token prompt: 128 tokens now and 3 next,
        not 131 padded to 160."""
        buckets = self.token_buckets
        if not buckets or self.is_static:
            return num_new
        total = scheduled + num_new
        i = bisect.bisect_left(buckets, total)
        if i == 0 or i == len(buckets) or buckets[i] == total:
            return num_new
        below = buckets[i - 1]
        if below < MIN_ALIGNED_TOKENS:
            return num_new  # a short step's cost is its weights' reads: padding costs little
        cut = total - below
        return num_new - cut if scheduled < below and cut < buckets[i] - total else num_new

    def _take_blocks(
        self, request: Request, budget: int, aligns: ScheduleStep | None = None
    ) -> int | None:
        """Take blocks for a waiting request's first chunk of at most `budget` tokens (cut
        to end the step `aligns` at a bucket's top, `_bucket_aligned`) and set its computed
        tokens to what it shares; the chunk's size, or None (nothing taken) when the free
        blocks do not suffice."""
        kv = self.kv_cache_manager
        num_shared = request.num_prompt_tokens - 1
        if request.fork_source is not None and not kv.can_fork(request.fork_source, num_shared):
            request.fork_source = None  # its source freed window blocks: prefill instead
        if request.fork_source is not None:
            # Share the whole prompt but its last token, which the child runs to sample.
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
            if aligns is not None:
                scheduled = self.scheduler_config.max_num_batched_tokens - aligns.budget
                whole, num_new = num_new, self._bucket_aligned(num_new, scheduled)
                aligns.at_bucket_top = num_new < whole
            # The static baseline reserves a whole max_model_len sequence up front.
            reserve = self.scheduler_config.max_model_len if self.is_static else 0
            if not kv.allocate_slots(request, num_new, prefix, reserve):
                return None
            request.num_computed_tokens = num_shared
        if request.num_cached_tokens is None:
            request.num_cached_tokens = num_shared
        return num_new

    def _preempt(self, step: ScheduleStep, request: Request) -> None:
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
            self._requeue(self.swapped, request)
            return
        # A request of the unit being scheduled may hold blocks this step never writes.
        kv.drop_unwritten(request)
        kv.free(request.request_id)
        self._num_recomputed_tokens += request.num_computed_tokens
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        self._requeue(self.waiting, request)

    def _schedule_swapped(self, step: ScheduleStep) -> None:
        """Swap requests back in, oldest first, while sequences, budget and blocks allow;
        each runs this step (its blocks are copied in before the forward)."""
        kv = self.kv_cache_manager
        while self.swapped and step.budget > 0:
            request = self.swapped[0]
            if (
                request.num_output_placeholders
                or len(self.running) >= self.scheduler_config.max_num_seqs
                or not self._adapter_fits(self._running_adapters(), request)
            ):
                return  # its last token is still on the device, or no seat or LoRA slot
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
            self._join(self.running, request)
            fits = kv.allocate_slots(request, num_new)  # swap_in left room for it
            assert fits, request
            self._add_row(step, request, num_new)

    def _join(self, queue: MutableSequence[Request], request: Request) -> None:
        """Appends a new member to `waiting` or `running`: after every request of the same
        or higher priority when queues are sorted (so a unit's members stay together)."""
        if self.by_priority:
            key = priority_key(request)
            queue.insert(bisect.bisect_right(queue, key, key=priority_key), request)
        else:
            queue.append(request)

    def _requeue(self, queue: deque[Request], request: Request) -> None:
        """Puts a preempted request back at the front of `waiting` or `swapped`: before
        every request of the same priority and arrival when queues are sorted."""
        if self.by_priority:
            key = priority_key(request)
            queue.insert(bisect.bisect_left(queue, key, key=priority_key), request)
        else:
            queue.appendleft(request)


def priority_key(request: Request) -> tuple[int, float]:
    """The priority policy's order: lower priority value first, then earlier arrival."""
    return request.priority, request.arrival_time


def is_unforked_beam(request: Request) -> bool:
    """The one request of a beam search before its first selection."""
    return request.beam_group is not None and not request.output_token_ids
