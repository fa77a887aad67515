"""LLMEngine: requests in, RequestOutputs out, one `step()` at a time.

Owns admitting requests (`validation.py` checks them first), the fan-out of `n > 1`
into sibling sequences, seeds, stop checks (EOS, stop token ids, stop strings,
max_tokens, max_model_len), incremental detokenization, logprob bookkeeping and
metrics. Scheduling belongs to `Scheduler`; all device work to the runner it is
given (`StepRunner`), so this module stays host-only and never imports jax.

With `async_scheduling` (the default) the host never sits between device steps: each
`step()` schedules and dispatches step N + 1, then waits for step N and commits it,
so scheduling, packing and detokenization overlap the device's work. Stop checks trail
by one step; a row dispatched for a request that has since finished is dropped
unseen, so no extra token is ever emitted. With speculative decoding
(`spec_decode.py`) each step waits for the one before: the drafts come from its tokens.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from jvllm.config import EngineConfig
from jvllm.engine.beam_search import Beam, BeamGroup, Candidates, check_beam_search
from jvllm.engine.kv_cache_manager import cdiv
from jvllm.engine.request import Request, RequestStatus
from jvllm.engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from jvllm.engine.sequence_group import SequenceGroup, SequenceState
from jvllm.engine.spec_decode import Speculator, StepSequence, spec_metrics, verify
from jvllm.engine.structured_output import GrammarCompiler
from jvllm.engine.token_constraints import constraints_for, step_sampling
from jvllm.engine.validation import validate_request
from jvllm.outputs import RequestOutput
from jvllm.sampling_params import BeamSearchParams, SamplingParams, SamplingRow


class StepRunner(Protocol):
    """What the engine needs from the device side (`jvllm.runner.ModelRunner`)."""

    num_compilations: int

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None: ...

    def swap_out(self, pairs: Sequence[tuple[int, int]]) -> None:
        """(device, host) block copies, queued before anything this step writes."""

    def swap_in(self, pairs: Sequence[tuple[int, int]]) -> None:
        """(host, device) block copies, queued before the step's forward."""

    def dispatch(
        self,
        rows: Sequence[ScheduledRequest],
        sampling_rows: Sequence[SamplingRow] | LateSampling,
        prompt_targets: Sequence[Sequence[int]] | None = None,
        token_bitmask: np.ndarray | None = None,
        block_tables: np.ndarray | None = None,
    ) -> Any:
        """Queues the step; the returned handle's `result()` waits for it. With a
        `LateSampling`, the runner queues the forward first and calls it for the rows
        and the bitmask (`i32[rows, W]`, or None) before queueing the sampler.
        `block_tables` is the step's `SchedulerOutput.block_tables` (rows index it by
        their `table_row`)."""


# Called once the forward is queued: the sampling rows and token bitmask of the step.
LateSampling = Callable[[], tuple[Sequence[SamplingRow], "np.ndarray | None"]]


@dataclass(frozen=True)
class _InFlight:
    """A dispatched step, with what committing it needs."""

    sched: SchedulerOutput
    states: list[SequenceState | Beam]
    want_prompt: list[bool]
    pending: Any  # the runner's handle; result() -> StepResult


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        tokenizer: Any,
        runner: StepRunner,
        num_blocks: int,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        num_host_blocks: int = 0,
        num_tier_blocks: int = 0,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.runner = runner
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = config.scheduler_config.max_model_len
        spec = config.speculative_config
        drafting = spec is not None and spec.method in ("draft_model", "eagle")
        self.scheduler = Scheduler(
            config.scheduler_config,
            config.cache_config,
            num_blocks,
            num_host_blocks,
            num_tier_blocks,
            # A draft model or EAGLE head writes its proposals' K/V past the scheduled
            # positions.
            spec.num_speculative_tokens if drafting else 0,
        )
        self._rng = random.Random(config.model_config.seed)
        self._groups: dict[str, SequenceGroup] = {}
        self._seqs: dict[str, SequenceState] = {}  # child request id -> its state
        self._beam_groups: dict[str, BeamGroup] = {}
        self._beams: dict[str, Beam] = {}  # live beam's request id -> the beam
        self._finished_outputs: list[RequestOutput] = []  # aborted before their next step
        self.speculator = None
        if spec is not None:
            tables = self.scheduler.kv_cache_manager.get_block_table
            draft = runner if drafting else None
            self.speculator = Speculator(spec, self.max_model_len, draft, tables)
        # Drafts are proposed from the tokens of the step before: no overlap.
        self.async_scheduling = config.scheduler_config.async_scheduling and spec is None
        self._in_flight: _InFlight | None = None  # dispatched, not yet committed
        self.prompt_tokens = 0
        self.generation_tokens = 0
        # Thread-safe: the server compiles a request's grammar before it reaches us.
        self.structured_outputs = GrammarCompiler(tokenizer, vocab_size, eos_token_ids)
        # Live sequences with a token mask, and those whose next row needs the token
        # just sampled (a grammar, multi-token bad words): most steps have neither.
        self._masked: set[str] = set()
        self._late: set[str] = set()
        # Live sequences that score their prompt (prompt logprobs): most steps have none.
        self._scoring: set[str] = set()

    # -- requests in --

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | dict[str, Any],
        params: SamplingParams | BeamSearchParams,
        arrival_time: float | None = None,
    ) -> None:
        """Validates and queues a request (a beam search with BeamSearchParams); raises
        ValueError before it enters the engine."""
        if request_id in self._groups or request_id in self._beam_groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, ids = self._tokenize(prompt)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        if isinstance(params, BeamSearchParams):
            self._add_beam_search(request_id, text, ids, params, arrival)
            return
        validate_request(text, ids, params, self.vocab_size, self.max_model_len)
        constraints = constraints_for(
            params, self.tokenizer, self.vocab_size, self.structured_outputs
        )
        group = SequenceGroup(request_id, text, ids, params, arrival)
        # The output length that ends a sequence: max_tokens, or the context's end.
        max_outputs = min(params.max_tokens or self.max_model_len, self.max_model_len - len(ids))
        for index in range(params.n):
            child_id = f"{request_id}#{index}" if params.n > 1 else request_id
            source = group.child_ids[0] if index else None
            request = Request(child_id, ids, params, arrival, fork_source=source)
            seed = self._seed_for(params, index)
            state = SequenceState(
                request,
                index,
                seed,
                self.tokenizer,
                self.eos_token_ids,
                max_outputs,
                constraints(index),
            )
            group.add(state)
            self._seqs[child_id] = state
            if state.constraints.masks:
                self._masked.add(child_id)
            if state.constraints.needs_latest_token:
                self._late.add(child_id)
            if state.prompt_logprobs is not None:
                self._scoring.add(child_id)
        self._groups[request_id] = group
        for state in group.children:
            self.scheduler.add_request(state.request)
        self.prompt_tokens += len(ids)

    def _add_beam_search(
        self,
        request_id: str,
        text: str | None,
        ids: list[int],
        params: BeamSearchParams,
        arrival: float,
    ) -> None:
        sched = self.config.scheduler_config
        validate_request(text, ids, SamplingParams(), self.vocab_size, self.max_model_len)
        if sched.scheduling_policy == "static":
            raise ValueError("beam search needs scheduling_policy='continuous', not 'static'")
        group = BeamGroup(
            request_id, text, ids, params, self.eos_token_ids, self.max_model_len, arrival
        )
        blocks_per_beam = cdiv(len(ids) + group.max_generated, self.config.cache_config.block_size)
        num_usable = self.scheduler.kv_cache_manager.block_pool.num_usable_blocks
        check_beam_search(params, sorted(self.eos_token_ids), sched, num_usable, blocks_per_beam)
        self._beam_groups[request_id] = group
        (root,) = group.beams
        self._beams[root.request.request_id] = root
        self.scheduler.add_request(root.request)
        self.prompt_tokens += len(ids)

    def _tokenize(self, prompt: str | list[int] | dict[str, Any]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a dict prompt needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            return prompt, list(self.tokenizer.encode(prompt)) if prompt else []
        if isinstance(prompt, list | tuple):
            return None, [int(t) for t in prompt]
        raise ValueError(f"prompt must be a string, a token id list or a dict, got {type(prompt)}")

    def _seed_for(self, params: SamplingParams, index: int) -> int:
        if params.seed is None:
            return self._rng.getrandbits(32)
        # Siblings of one seeded request draw distinct, reproducible streams.
        return random.Random(f"{params.seed}:{index}").getrandbits(32)

    def abort_request(self, request_id: str) -> None:
        """Stops a request (all its sequences) and frees its blocks at once."""
        beams = self._beam_groups.get(request_id)
        if beams is not None:
            self._retire_beams(beams, RequestStatus.FINISHED_ABORTED)
            self._finished_outputs.append(beams.output(self.tokenizer))
            return
        group = self._groups.get(request_id)
        if group is None:
            return
        for state in group.children:
            if not state.finished:
                self._finish(state, RequestStatus.FINISHED_ABORTED)
        self._finished_outputs.append(self._retire(group))

    # -- one step --

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups or self._beam_groups) or self._in_flight is not None

    def step(self, final_only: bool = False) -> list[RequestOutput]:
        """Schedules and dispatches one device step, commits the step before it (or,
        without async scheduling, this one), and returns the outputs of every request
        that progressed, as its `output_kind` asks (cumulative by default, as vLLM's),
        or with `final_only` just those that finished, whole (offline use)."""
        outputs, self._finished_outputs = self._finished_outputs, []
        sched = self.scheduler.schedule()
        for request_id in sched.preempted_request_ids:
            if request_id in self._beams:
                self._beams[request_id].candidates = None  # it recomputes and proposes again
        if sched.blocks_to_swap_out:
            self.runner.swap_out(sched.blocks_to_swap_out)
        if sched.blocks_to_swap_in:
            self.runner.swap_in(sched.blocks_to_swap_in)
        if sched.blocks_to_copy:
            self.runner.copy_blocks(sched.blocks_to_copy)
        previous, self._in_flight = self._in_flight, None
        launched = None
        if sched.scheduled:
            launched, committed = self._launch(sched, previous, final_only)
            if committed is not None:  # the step needed the previous step's tokens
                outputs += committed
                previous = None
        self._in_flight = launched
        if previous is not None:
            outputs += self._commit(previous, final_only)
        if launched is None:
            self.scheduler.update_from_output(sched, {})
        elif not self.async_scheduling:
            self._in_flight = None
            outputs += self._commit(launched, final_only)
        return outputs

    def _launch(
        self, sched: SchedulerOutput, previous: _InFlight | None, final_only: bool
    ) -> tuple[_InFlight, list[RequestOutput] | None]:
        """Dispatches the step. Where a row's bans or grammar need the token the previous
        step sampled, the forward is queued first, then the previous step committed
        (returned), then the sampler queued with what that token allows."""
        rows = sched.scheduled
        states = [self._seqs.get(row.request_id) or self._beams[row.request_id] for row in rows]
        want_prompt = [False] * len(rows)
        if self._scoring:
            want_prompt = [s.wants_prompt_logprobs(r) for s, r in zip(states, rows, strict=True)]
        targets = None
        if any(want_prompt):
            targets = [
                s.prompt_targets(row) if want else [0] * len(row.token_ids)
                for s, row, want in zip(states, rows, want_prompt, strict=True)
            ]
        if (
            previous is not None
            and self._late
            and any(r.prev_step_row is not None and r.request_id in self._late for r in rows)
        ):
            committed: list[RequestOutput] = []

            def late() -> tuple[list[SamplingRow], np.ndarray | None]:
                committed.extend(self._commit(previous, final_only))
                return self._sampling(states, rows)

            pending = self.runner.dispatch(rows, late, targets, block_tables=sched.block_tables)
            return _InFlight(sched, states, want_prompt, pending), committed
        sampling_rows, bitmask = self._sampling(states, rows)
        pending = self.runner.dispatch(rows, sampling_rows, targets, bitmask, sched.block_tables)
        return _InFlight(sched, states, want_prompt, pending), None

    def _sampling(
        self, states: Sequence[SequenceState | Beam], rows: Sequence[ScheduledRequest]
    ) -> tuple[list[SamplingRow], np.ndarray | None]:
        return step_sampling(
            states, rows, self.eos_token_ids, self._masked, self.structured_outputs, self.vocab_size
        )

    def _commit(self, flight: _InFlight, final_only: bool) -> list[RequestOutput]:
        """Waits for a dispatched step and applies its tokens: stop checks, text, outputs."""
        result = flight.pending.result()
        rows = flight.sched.scheduled
        # Each row's first sampling row: rows verifying k drafts take 1 + k.
        at: Sequence[int] = range(len(rows))
        verified: dict[str, list[int]] | None = None
        speculator = self.speculator
        if speculator is not None and any(row.num_spec_tokens for row in rows):
            at, verified = self._verify(rows, result)
        tokens = result.token_ids.tolist()  # one conversion, not one per row
        # Row i's token is at its first sampling row.
        sampled = tokens if verified is None else [tokens[a] for a in at]
        self.scheduler.update_from_output(flight.sched, sampled, verified)
        outputs: list[RequestOutput] = []
        touched: dict[str, SequenceGroup] = {}  # requests of n > 1 sequences this step
        proposed: dict[str, BeamGroup] = {}
        drafting: list[StepSequence] = []  # sequences to draft for
        generated = 0  # one-token rows' tokens, added to generation_tokens once
        states = zip(flight.states, rows, flight.want_prompt, strict=True)
        for i, (state, row, want_prompt) in enumerate(states):
            if isinstance(state, Beam):
                # Preempted since dispatch: not awaiting selection, it proposes again.
                if not state.finished and row.samples and state.request.awaiting_selection:
                    state.candidates = self._candidates(result, i, state.group_id)
                    proposed[state.group_id] = self._beam_groups[state.group_id]
                continue
            if state.finished_status is not None:
                continue  # stopped or aborted after this step was dispatched
            if want_prompt:
                state.add_prompt_logprobs(row, result.prompt_logprobs[i])
            speculates = speculator is not None and state.constraints.grammar is None
            if row.samples:
                num = 1
                if verified and row.num_spec_tokens:
                    num = len(verified[row.request_id])
                    self._add_tokens(state, result, at[i], num)
                else:  # one token: `_add_tokens` inlined (this runs per row and step)
                    generated += 1
                    num_out = len(state.request.output_token_ids)
                    token = state.request.output_token_ids[-1]
                    if state.add_token(result, at[i], token, num_out):
                        self._check_stop(state, num_out)
                if speculates and state.finished_status is None:
                    # The newest token came from the row's num-th logits row.
                    drafting.append(StepSequence(state.request, state.seed, at[i] + num - 1, True))
            elif speculates and speculator.wants_every_row:
                drafting.append(StepSequence(state.request, state.seed, at[i], False))
            group = state.group
            if len(group.children) > 1:
                touched[group.request_id] = group  # its output once all its rows are in
            elif state.finished_status is not None:
                outputs.append(self._retire(group, final_only))
            elif not final_only and (out := group.output()) is not None:
                outputs.append(out)  # None: FINAL_ONLY, or a DELTA with nothing new
        self.generation_tokens += generated
        if speculator is not None:
            speculator.propose(drafting)
        outputs += [out for beams in proposed.values() if (out := self._select(beams))]
        for group in touched.values():
            if group.finished:
                outputs.append(self._retire(group, final_only))
            elif not final_only and (out := group.output()) is not None:
                outputs.append(out)  # None: FINAL_ONLY, or a DELTA with nothing new
        return outputs

    def _verify(
        self, rows: Sequence[ScheduledRequest], result: Any
    ) -> tuple[list[int], dict[str, list[int]]]:
        """Each row's first sampling row, and what the rows with drafts emit."""
        assert self.speculator is not None
        at, verified, next_at = [], {}, 0
        for row in rows:
            at.append(next_at)
            k = row.num_spec_tokens
            if k and row.samples:
                drawn = result.token_ids[next_at : next_at + 1 + k]
                verified[row.request_id] = emitted = verify(row.token_ids[-k:], drawn)
                self.speculator.observe(k, emitted)
            next_at += 1 + k
        return at, verified

    def _add_tokens(self, state: SequenceState, result: Any, at: int, num: int) -> None:
        """Records the `num` tokens the scheduler appended (sampling rows at, at + 1, ...),
        checking stops after each: tokens after a stop are dropped."""
        outputs = state.request.output_token_ids
        base = len(outputs) - num
        for j in range(num):
            self.generation_tokens += 1
            if state.add_token(result, at + j, outputs[base + j], base + j + 1):
                self._check_stop(state, base + j + 1)  # most tokens never get here
                if state.finished:
                    del outputs[base + j + 1 :]
                    return

    def _candidates(self, result: Any, row: int, group_id: str) -> Candidates:
        k = self._beam_groups[group_id].num_candidates
        return Candidates(result.top_ids[row][:k].tolist(), result.top_logprobs[row][:k].tolist())

    def _select(self, group: BeamGroup) -> RequestOutput | None:
        """Advances a beam search whose live beams have all proposed; its output once done."""
        if not group.ready:
            return None
        continuations, done = group.select()
        if done:
            self._retire_beams(group, RequestStatus.FINISHED_STOPPED)
            return group.output(self.tokenizer)
        parents = group.beams
        children = group.continue_with(continuations)
        pairs = [
            (beam.request, c.parent.request)
            for beam, c in zip(children, continuations, strict=True)
        ]
        self.scheduler.replace_beams([p.request for p in parents], pairs)
        for parent in parents:
            parent.finished = True
            del self._beams[parent.request.request_id]
        for beam in children:
            self._beams[beam.request.request_id] = beam
        self.generation_tokens += len(children)
        return None

    def _retire_beams(self, group: BeamGroup, status: RequestStatus) -> None:
        for beam in group.beams:
            beam.finished = True
            del self._beams[beam.request.request_id]
            self.scheduler.finish_request(beam.request.request_id, status)
        del self._beam_groups[group.request_id]

    def _check_stop(self, state: SequenceState, num_out: int) -> None:
        """Whether the sequence stops at its first `num_out` output tokens."""
        request, params = state.request, state.request.sampling_params
        token = request.output_token_ids[num_out - 1]
        num_tokens = request.num_prompt_tokens + num_out
        stopped, length = RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH
        reason: tuple[RequestStatus, int | str | None] | None = None
        grammar = state.constraints.grammar
        if state.matched_stop is not None:
            reason = (stopped, state.matched_stop)
        elif grammar is not None and grammar.is_stopped:
            reason = (stopped, token if token in params.stop_token_ids else None)
        elif num_out >= params.min_tokens and token in params.stop_token_ids:
            reason = (stopped, token)
        elif num_out >= params.min_tokens and not params.ignore_eos and token in self.eos_token_ids:
            reason = (stopped, None)
        elif num_out >= (params.max_tokens or self.max_model_len) or (
            num_tokens >= self.max_model_len
        ):
            reason = (length, None)
        if reason is not None:
            self._finish(state, *reason)

    def _finish(
        self, state: SequenceState, status: RequestStatus, stop_reason: int | str | None = None
    ) -> None:
        """Ends a sequence: its output says why, and the scheduler frees its blocks now."""
        state.finish(status, stop_reason)
        self.scheduler.finish_request(state.request.request_id, status)

    def _retire(self, group: SequenceGroup, final_only: bool = False) -> RequestOutput:
        del self._groups[group.request_id]
        for child_id in group.child_ids:
            self._seqs.pop(child_id, None)
            if self.speculator is not None:
                self.speculator.forget(child_id)
            self._masked.discard(child_id)
            self._late.discard(child_id)
            self._scoring.discard(child_id)
        out = group.output(final_only)
        assert out is not None  # a finished group always has its last output
        return out

    # -- metrics --

    def get_metrics(self) -> dict[str, Any]:
        st = self.scheduler.stats()
        spec = self.speculator.metrics() if self.speculator is not None else spec_metrics()
        return spec | {
            "num_requests_running": st.num_running,
            "num_requests_waiting": st.num_waiting,
            "kv_cache_usage_perc": st.kv_cache_usage_perc,
            "num_free_blocks": st.num_free_blocks,
            "num_total_blocks": st.num_total_blocks,
            "prefix_cache_queries": st.prefix_cache_queries,
            "prefix_cache_hits": st.prefix_cache_hits,
            "num_preemptions": st.num_preemptions,
            "prompt_tokens": self.prompt_tokens,
            "generation_tokens": self.generation_tokens,
            "num_compilations": self.runner.num_compilations,
            "num_live_tokens": st.num_live_tokens,
            "num_allocated_slots": st.num_allocated_slots,
            "num_requests_swapped": st.num_swapped,
            "num_swapped_out_blocks": st.num_swapped_out_blocks,
            "num_swapped_in_blocks": st.num_swapped_in_blocks,
            "num_recomputed_tokens": st.num_recomputed_tokens,
            "num_host_blocks": st.num_host_blocks,
            "num_free_host_blocks": st.num_free_host_blocks,
            "prefix_cache_host_hits": st.prefix_cache_host_hits,
            "num_offloaded_blocks": st.num_offloaded_blocks,
            "num_onloaded_blocks": st.num_onloaded_blocks,
            "num_tier_blocks": st.num_tier_blocks,
            "num_used_tier_blocks": st.num_used_tier_blocks,
        }
