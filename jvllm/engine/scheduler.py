"""Scheduler: which requests run in the next step, and how many tokens each.

Owns the waiting queue and the running list, the per-step token budget
(`max_num_batched_tokens`) and sequence limit (`max_num_seqs`), chunked prefill,
preemption by recompute, the admission of n > 1 siblings by forking their source's KV
blocks, and the "static" policy used as a baseline. Block accounting is delegated to the
KV cache manager; stop conditions, detokenization and outputs belong to the LLM engine.

Protocol: `schedule()`, run the step, then `update_from_output()` before the next
`schedule()`. The engine checks stop conditions and calls `finish_request()` itself.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

from jvllm.config import CacheConfig, SchedulerConfig
from jvllm.engine.kv_cache_manager import KVCacheManager, cdiv
from jvllm.engine.request import Request, RequestStatus


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step."""

    request_id: str
    token_ids: list[int]  # all_token_ids[start_position : start_position + len(token_ids)]
    start_position: int  # num_computed_tokens before the step: the position of token_ids[0]
    block_table: list[int]  # covers at least start_position + len(token_ids) positions
    samples: bool  # every known token is computed after this step, so one is sampled


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]  # running requests first, then newly admitted ones
    blocks_to_copy: list[tuple[int, int]]  # (src, dst), applied before this step's forward
    preempted_request_ids: list[str]
    num_scheduled_tokens: int


class SchedulerStats(NamedTuple):
    num_running: int
    num_waiting: int  # including preempted requests
    num_free_blocks: int  # of the usable blocks (the null block is not counted)
    num_total_blocks: int  # usable blocks: num_blocks - 1
    kv_cache_usage_perc: float  # 0..1, usable blocks held by some request
    prefix_cache_queries: int  # tokens, cumulative
    prefix_cache_hits: int  # tokens, cumulative
    num_preemptions: int  # cumulative
    num_live_tokens: int  # running requests' computed + in-flight tokens
    num_allocated_slots: int  # held blocks * block_size


@dataclass
class _Step:
    """What one `schedule()` call has decided so far."""

    budget: int
    rows: list[ScheduledRequest] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)


class Scheduler:
    def __init__(
        self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, num_blocks: int
    ) -> None:
        blocks_per_seq = cdiv(scheduler_config.max_model_len, cache_config.block_size)
        if num_blocks - 1 < blocks_per_seq:
            raise ValueError(
                f"num_blocks={num_blocks} (one reserved) cannot hold one sequence of "
                f"max_model_len={scheduler_config.max_model_len} tokens, which needs "
                f"{blocks_per_seq + 1} blocks of block_size={cache_config.block_size}; "
                "lower max_model_len or give the KV cache more memory "
                "(gpu_memory_utilization, num_gpu_blocks_override)"
            )
        self.scheduler_config = scheduler_config
        self.block_size = cache_config.block_size
        self.is_static = scheduler_config.scheduling_policy == "static"
        self.kv_cache_manager = KVCacheManager(
            num_blocks, cache_config.block_size, cache_config.enable_prefix_caching
        )
        self.waiting: deque[Request] = deque()  # FIFO; preempted requests go to the front
        self.running: list[Request] = []  # admission order: the tail is preempted first
        self._requests: dict[str, Request] = {}  # every unfinished request
        self._in_flight: dict[str, int] = {}  # tokens scheduled but not yet committed
        self._num_preemptions = 0

    def add_request(self, request: Request) -> None:
        if request.request_id in self._requests:
            raise ValueError(f"request_id {request.request_id!r} is already in the scheduler")
        if not request.prompt_token_ids:
            raise ValueError(f"request {request.request_id!r} has an empty prompt")
        max_model_len = self.scheduler_config.max_model_len
        if request.num_tokens > max_model_len:
            raise ValueError(
                f"request {request.request_id!r} has {request.num_tokens} tokens, more than "
                f"max_model_len={max_model_len}"
            )
        assert request.status is RequestStatus.WAITING, request
        self._requests[request.request_id] = request
        self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        assert not self._in_flight, "update_from_output() must follow every schedule()"
        step = _Step(budget=self.scheduler_config.max_num_batched_tokens)
        self._schedule_running(step)
        # A step that had to preempt has no blocks to spare for newcomers.
        if not step.preempted_ids and not (self.is_static and self.running):
            self._schedule_waiting(step)
        self._in_flight = {row.request_id: len(row.token_ids) for row in step.rows}
        return SchedulerOutput(
            scheduled=step.rows,
            blocks_to_copy=self.kv_cache_manager.take_blocks_to_copy(),
            preempted_request_ids=step.preempted_ids,
            num_scheduled_tokens=sum(self._in_flight.values()),
        )

    def update_from_output(self, output: SchedulerOutput, sampled: dict[str, int]) -> None:
        """Commit a step: advance computed tokens and append the sampled ones."""
        for row in output.scheduled:
            request = self._requests.get(row.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # finished (or preempted) since it was scheduled
            assert request.num_computed_tokens == row.start_position, (request, row)
            request.num_computed_tokens += len(row.token_ids)
            if row.samples:
                request.output_token_ids.append(sampled[row.request_id])
        self._in_flight.clear()

    def finish_request(self, request_id: str, status: RequestStatus) -> None:
        """Finish a waiting, running or preempted request and free its blocks now.

        The scheduler forgets the request: unknown or already finished ids are ignored.
        """
        assert status.is_finished, status
        request = self._requests.pop(request_id, None)
        if request is None:
            return
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.kv_cache_manager.free(request_id)
        self._in_flight.pop(request_id, None)
        request.status = status

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def get_request(self, request_id: str) -> Request:
        """An unfinished request by id (KeyError once it is finished)."""
        return self._requests[request_id]

    def stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        pool = kv.block_pool
        live = sum(
            r.num_computed_tokens + self._in_flight.get(r.request_id, 0) for r in self.running
        )
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
        )

    def _schedule_running(self, step: _Step) -> None:
        index = 0
        while index < len(self.running) and step.budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, step.budget)
            assert num_new > 0, f"{request} has nothing to compute"
            while not self.kv_cache_manager.allocate_slots(request, num_new):
                # Preempt the most recently admitted request that is not scheduled yet:
                # everything before `index` is scheduled, so the tail is always eligible.
                victim = self.running.pop()
                self._preempt(victim)
                step.preempted_ids.append(victim.request_id)
                if victim is request:
                    return
            self._add_row(step, request, num_new)
            index += 1

    def _schedule_waiting(self, step: _Step) -> None:
        """Admit waiting requests in FIFO order while budget, sequences and blocks allow."""
        skipped: list[Request] = []
        max_num_seqs = self.scheduler_config.max_num_seqs
        while self.waiting and step.budget > 0 and len(self.running) < max_num_seqs:
            request = self.waiting.popleft()
            if self._must_wait_for_source(request):
                skipped.append(request)  # does not hold up the requests behind it
                continue
            if not self._admit(request, step):
                self.waiting.appendleft(request)
                break
        self.waiting.extendleft(reversed(skipped))

    def _must_wait_for_source(self, request: Request) -> bool:
        """Whether a fork child waits for its source to compute the shared prompt."""
        if request.fork_source is None:
            return False
        source = self._requests.get(request.fork_source)
        if self.is_static or source is None or source.status is RequestStatus.PREEMPTED:
            request.fork_source = None  # nothing to share: prefill like any request
            return False
        assert source.prompt_token_ids == request.prompt_token_ids, (source, request)
        return (
            source.status is not RequestStatus.RUNNING
            or source.num_computed_tokens < request.num_prompt_tokens - 1
        )

    def _admit(self, request: Request, step: _Step) -> bool:
        """Take blocks for the request and schedule its first chunk; False if blocks run out."""
        kv = self.kv_cache_manager
        if request.fork_source is not None:
            # Share the whole prompt but its last token, which the child runs to sample.
            num_shared = request.num_prompt_tokens - 1
            kv.fork(request.fork_source, request.request_id, num_shared)
            request.num_computed_tokens = num_shared
            num_new = min(request.num_tokens - num_shared, step.budget)
            if not kv.allocate_slots(request, num_new):
                kv.free(request.request_id)
                request.num_computed_tokens = 0
                return False
        else:
            prefix = kv.find_cached_prefix(request)
            num_shared = prefix.num_tokens
            num_new = min(request.num_tokens - num_shared, step.budget)
            # The static baseline reserves a whole max_model_len sequence up front.
            reserve = self.scheduler_config.max_model_len if self.is_static else 0
            if not kv.allocate_slots(request, num_new, prefix, reserve):
                return False
            request.num_computed_tokens = num_shared
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_shared
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        self._add_row(step, request, num_new)
        return True

    def _preempt(self, request: Request) -> None:
        """Preempt by recompute: drop all its K/V; it prefills everything again later."""
        assert not self.is_static, "the static policy reserves blocks and never preempts"
        self.kv_cache_manager.free(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self._num_preemptions += 1
        self.waiting.appendleft(request)

    def _add_row(self, step: _Step, request: Request, num_new: int) -> None:
        start = request.num_computed_tokens
        end = start + num_new
        assert end <= self.scheduler_config.max_model_len, (request, num_new)
        step.rows.append(
            ScheduledRequest(
                request_id=request.request_id,
                token_ids=request.get_token_ids(start, end),
                start_position=start,
                block_table=self.kv_cache_manager.get_block_table(request.request_id),
                samples=end == request.num_tokens,
            )
        )
        step.budget -= num_new
