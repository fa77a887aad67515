"""LLMEngine: requests in, RequestOutputs out, one `step()` at a time.

Owns admitting requests (`validation.py` checks them first), the fan-out of `n > 1`
into sibling sequences, seeds, the order of one step, draft verification and
metrics. Scheduling belongs to `Scheduler`; committing a step's tokens (stop checks,
text, logprobs, outputs, the request states) to `OutputProcessor`; all device work to
the runner it is
given (`step_io.StepRunner`: `forward`, then `sample`), so this module stays host-only
and never imports jax.

With `async_scheduling` (the default) the host never sits between device steps: each
`step()` schedules and dispatches step N + 1, then waits for step N and commits it,
so scheduling, packing and detokenization overlap the device's work. Stop checks trail
by one step; a row dispatched for a request that has since finished is dropped
unseen, so no extra token is ever emitted. With speculative decoding (`spec_decode.py`)
the drafts come from the step before's tokens: `spec_step.py` orders such a step (a device
proposer's drafts stay there until the next forward is queued: `spec_in_flight.py`).
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from jvllm.config import EngineConfig
from jvllm.engine.beam_search import Beam, BeamGroup, check_beam_search
from jvllm.engine.kv.kv_cache_manager import cdiv
from jvllm.engine.lora_slots import LoRASlots
from jvllm.engine.metrics import EngineStats, SpecDecodeStats
from jvllm.engine.multimodal import MultiModalProcessor, tokenize_prompt, with_mm_features
from jvllm.engine.output_processor import OutputProcessor, SampledRows, StepCommit
from jvllm.engine.request import Request
from jvllm.engine.sampling_batch import SamplingBatch
from jvllm.engine.scheduling.scheduler import Scheduler
from jvllm.engine.sequence_group import SequenceGroup, SequenceState
from jvllm.engine.spec_decode import Speculator
from jvllm.engine.spec_step import OVERLAPPED_METHODS, overlapped_step, verify_rows
from jvllm.engine.step_io import (
    KVTransfer,
    PendingResult,
    SamplingColumns,
    SchedulerOutput,
    StepRunner,
    StepSampling,
)
from jvllm.engine.structured_output import GrammarCompiler
from jvllm.engine.token_constraints import constraints_for, step_sampling
from jvllm.engine.validation import check_priority, validate_request
from jvllm.lora.request import LoRARequest
from jvllm.outputs import RequestOutput
from jvllm.sampling_params import BeamSearchParams, SamplingParams


class _Prepared(NamedTuple):
    """A scheduled step's rows as the engine sees them, before its sampler is queued."""

    sched: SchedulerOutput
    states: list[SequenceState | Beam]
    want_prompt: list[bool]  # per row: it scores its prompt (prompt logprobs)
    targets: list[list[int]] | None  # per row and token, the next prompt token to score


@dataclass(frozen=True)
class _InFlight:
    """A dispatched step, with what committing it needs."""

    sched: SchedulerOutput
    states: list[SequenceState | Beam]
    want_prompt: list[bool]
    pending: PendingResult


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
        on_device = spec is not None and spec.method != "ngram"
        # A draft model or EAGLE head writes its proposals' K/V past the scheduled
        # positions (Medusa heads keep no K/V).
        lookahead = on_device and spec.method != "medusa"
        self.scheduler = Scheduler(
            config.scheduler_config,
            config.cache_config,
            num_blocks,
            num_host_blocks,
            num_tier_blocks,
            spec.num_speculative_tokens if lookahead else 0,
            getattr(runner, "kv_sliding_window", None),  # a runner's hybrid KV layout
        )
        self.scheduler.token_buckets = getattr(runner, "token_buckets", None)
        self._rng = random.Random(config.model_config.seed)
        self.speculator = None
        if spec is not None:
            tables = self.scheduler.kv_cache_manager.get_block_table
            draft = runner if on_device else None
            self.speculator = Speculator(spec, self.max_model_len, draft, tables)
        self.output_processor = OutputProcessor(
            tokenizer,
            self.eos_token_ids,
            self.max_model_len,
            speculates=self.speculator is not None,
            drafts_every_row=self.speculator is not None and self.speculator.wants_every_row,
        )
        self.kv_transfer: KVTransfer | None = None  # the fs KV tier's (jvllm.kv_offload)
        self._held_outputs: list[RequestOutput] = []  # a producer's, until its KV is sent
        self.sampling_batch = SamplingBatch()  # the rows' sampling columns, by slot
        self._aborted_outputs: list[RequestOutput] = []  # returned by the next step
        self.async_scheduling = config.scheduler_config.async_scheduling and (
            spec is None or spec.method in OVERLAPPED_METHODS  # commits trail: spec_step.py
        )
        self._in_flight: _InFlight | None = None  # dispatched, not yet committed
        self.prompt_tokens = 0
        self.weight_version: str | int | None = None  # finish_weight_update's
        # Thread-safe: the server compiles a request's grammar before it reaches us.
        self.structured_outputs = GrammarCompiler(tokenizer, vocab_size, eos_token_ids)
        lora = config.lora_config
        self.lora_slots = LoRASlots(lora, runner) if lora is not None else None
        self.mm_processor: MultiModalProcessor | None = None  # images: set by engine_args

    # -- requests in --

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | dict[str, Any],
        params: SamplingParams | BeamSearchParams,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Validates and queues a request (a beam search with BeamSearchParams), with
        `lora_request`'s adapter when given; raises ValueError before it enters the
        engine. `priority` (scheduling_policy="priority"): lower runs first."""
        if request_id in self.output_processor.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        check_priority(priority, self.config.scheduler_config.scheduling_policy)
        text, ids, mm = tokenize_prompt(prompt, self.mm_processor, self._tokenize)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        if isinstance(params, BeamSearchParams):
            if lora_request is not None or mm:
                what = "a lora_request" if lora_request is not None else "images"
                raise ValueError(f"beam search does not take {what} yet")
            self._add_beam_search(request_id, text, ids, params, arrival)
            return
        validate_request(text, ids, params, self.vocab_size, self.max_model_len)
        if lora_request is not None:
            self.add_lora(lora_request)
        constraints = constraints_for(
            params, self.tokenizer, self.vocab_size, self.structured_outputs
        )
        group = SequenceGroup(request_id, text, ids, params, arrival)
        # The output length that ends a sequence: max_tokens, or the context's end.
        max_outputs = min(params.max_tokens or self.max_model_len, self.max_model_len - len(ids))
        for index in range(params.n):
            child_id = f"{request_id}#{index}" if params.n > 1 else request_id
            source = group.child_ids[0] if index else None
            request = Request(
                child_id,
                ids,
                params,
                arrival,
                fork_source=source,
                priority=priority,
                lora_request=lora_request,
                mm_features=mm,
            )
            seed = self._seed_for(params, index)
            state = SequenceState(
                request,
                index,
                seed,
                self.output_processor.sequence_tokenizer,
                self.eos_token_ids,
                max_outputs,
                constraints(index),
            )
            group.add(state)
        self.output_processor.add_group(group)
        for state in group.children:
            self.scheduler.add_request(state.request)
            if lora_request is not None and self.lora_slots is not None:
                self.lora_slots.hold(state.request.request_id, lora_request.lora_int_id)
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
        self.output_processor.add_beam_group(group)
        self.scheduler.add_request(group.beams[0].request)
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

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Reads and checks an adapter ahead of its requests (vLLM's `add_lora`); raises
        ValueError (`LoRAAdapterError`) naming what is wrong with it."""
        if self.lora_slots is None:
            raise ValueError(
                f"LoRA adapter {lora_request.lora_name!r} requested, but LoRA is off; start "
                "the engine with enable_lora=True (--enable-lora)"
            )
        self.lora_slots.add_lora(lora_request)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forgets an adapter; False if it was not loaded."""
        return self.lora_slots is not None and self.lora_slots.remove_lora(lora_int_id)

    def list_loras(self) -> set[int]:
        """The ids of the adapters loaded."""
        return set(self.lora_slots.list_loras()) if self.lora_slots is not None else set()

    def abort_request(self, request_id: str) -> None:
        """Stops a request (all its sequences) and frees its blocks at once."""
        commit = self.output_processor.abort(request_id)
        self._apply(commit)
        self._aborted_outputs += commit.outputs

    # -- one step --

    def has_unfinished_requests(self) -> bool:
        tier = self.scheduler.kv_cache_manager.disk_tier
        sending = tier is not None and tier.busy or bool(self._held_outputs)  # a producer's
        return bool(self.output_processor.requests) or self._in_flight is not None or sending

    def step(self, final_only: bool = False) -> list[RequestOutput]:
        """Schedules and queues one device step, commits the step before it (or,
        without async scheduling, this one), and returns the outputs of every request
        that progressed, as its `output_kind` asks (cumulative by default, as vLLM's),
        or with `final_only` just those that finished, whole (offline use)."""
        if self.async_scheduling and self.speculator is not None:
            return overlapped_step(self, final_only)
        outputs, self._aborted_outputs = self._aborted_outputs, []
        sched = self.scheduler.schedule()
        self.output_processor.forget_candidates(sched.preempted_request_ids)
        self._queue_block_moves(sched)
        previous, self._in_flight = self._in_flight, None
        if sched.scheduled:
            sched, prepared = self._forward(sched)
            if previous is not None and self.output_processor.needs_previous_tokens(
                sched.scheduled
            ):
                # Some row's bans or grammar need the token the previous step sampled.
                outputs += self._commit(previous, final_only)
                previous = None
            self._in_flight = self._sample(prepared)
        if previous is not None:
            outputs += self._commit(previous, final_only)
        if not sched.scheduled:
            self.scheduler.update_from_output(sched, {})
        elif not self.async_scheduling:
            launched, self._in_flight = self._in_flight, None
            assert launched is not None
            outputs += self._commit(launched, final_only)
        return self._once_sent(outputs)

    def _forward(self, sched: SchedulerOutput) -> tuple[SchedulerOutput, _Prepared]:
        """Queues the step's forward: the rows' states taken first (before a commit can
        retire one), then the step's adapters, images and device drafts added."""
        prepared = self._prepare(sched)
        if self.lora_slots is not None:  # the step's adapters into the device slots
            sched = self.lora_slots.assign_slots(sched, prepared.states)
        if self.mm_processor is not None:  # the images the rows cover, for the encoder
            sched = with_mm_features(sched, self.scheduler.running)
        if self.speculator is not None:  # drafts still on the device
            sched = self.speculator.feed(sched)
        self.runner.forward(sched)
        return sched, prepared

    def _once_sent(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """A disaggregated prefill's producer answers once its requests' KV blocks are
        sent, so the decode server asked next finds them."""
        tier = self.scheduler.kv_cache_manager.disk_tier
        if tier is None or tier.role != "kv_producer":
            return outputs
        self._held_outputs += outputs
        if tier.busy:
            return []
        outputs, self._held_outputs = self._held_outputs, []
        return outputs

    def _queue_block_moves(self, sched: SchedulerOutput) -> None:
        """Queues the step's swaps and copies before its forward."""
        disk_tier = self.scheduler.kv_cache_manager.disk_tier
        if disk_tier is not None and self.kv_transfer is not None:
            disk_tier.complete(self.kv_transfer.submit(disk_tier.take_ops()))
        if sched.blocks_to_swap_out:
            self.runner.swap_out(sched.blocks_to_swap_out)
        if sched.blocks_to_swap_in:
            self.runner.swap_in(sched.blocks_to_swap_in)
        if sched.blocks_to_copy:
            self.runner.copy_blocks(sched.blocks_to_copy)

    def _prepare(self, sched: SchedulerOutput) -> _Prepared:
        """The step's rows' states and the prompt tokens they score."""
        rows, processor = sched.scheduled, self.output_processor
        states = processor.states(rows)
        want_prompt = [False] * len(rows)
        if processor.num_scoring:
            want_prompt = [s.wants_prompt_logprobs(r) for s, r in zip(states, rows, strict=True)]
        targets = None
        if any(want_prompt):
            targets = [
                s.prompt_targets(row) if want else [0] * len(row.token_ids)
                for s, row, want in zip(states, rows, want_prompt, strict=True)
            ]
        return _Prepared(sched, states, want_prompt, targets)

    def _sample(self, step: _Prepared) -> _InFlight:
        """Queues the sampler of the step whose forward was just queued."""
        if self.speculator is not None:
            self.speculator.resolve(step.sched.scheduled)
        sampling_rows, bitmask = self._sampling(step.states, step.sched)
        pending = self.runner.sample(StepSampling(sampling_rows, bitmask, step.targets))
        return _InFlight(step.sched, step.states, step.want_prompt, pending)

    def _sampling(
        self, states: Sequence[SequenceState | Beam], sched: SchedulerOutput
    ) -> tuple[SamplingColumns, np.ndarray | None]:
        """The step's sampling columns: the persistent batch's, or whole rows with a mask
        or drafts (`step_sampling`)."""
        rows, eos = sched.scheduled, self.eos_token_ids
        any_masked = self.output_processor.num_masked > 0
        drafts = self.speculator is not None and any(row.num_spec_tokens for row in rows)
        if not any_masked and not drafts:
            return self.sampling_batch.columns(states, rows, eos, sched.columns), None
        sampling_rows, bitmask = step_sampling(
            states, rows, eos, any_masked, self.structured_outputs, self.vocab_size
        )
        return SamplingColumns.from_rows(sampling_rows), bitmask

    def _commit(self, flight: _InFlight, final_only: bool) -> list[RequestOutput]:
        """Waits for a dispatched step and applies its tokens: the scheduler's first
        (token ids, blocks), then the output processor's (stops, text, outputs)."""
        result = flight.pending.result()
        rows = flight.sched.scheduled
        sampled = SampledRows(range(len(rows)), None)
        if self.speculator is not None and any(row.num_spec_tokens for row in rows):
            sampled = verify_rows(self.speculator, rows, flight.states, result)
        tokens = result.token_ids.tolist()  # one conversion, not one per row
        if sampled.verified is not None:  # row i's token is at its first sampling row
            tokens = [tokens[a] for a in sampled.at]
        self.scheduler.update_from_output(flight.sched, tokens, sampled.verified)
        commit = self.output_processor.commit(
            flight.sched, flight.states, flight.want_prompt, result, sampled, final_only
        )
        self._apply(commit)
        if self.speculator is not None:
            self.speculator.propose(commit.drafting)
        return commit.outputs

    def _apply(self, commit: StepCommit) -> None:
        """Tells the scheduler (and the speculator) what a commit ended or continued."""
        for request_id, status in commit.finished:
            self.scheduler.finish_request(request_id, status)
            if self.lora_slots is not None:
                self.lora_slots.release(request_id)
            if self.speculator is not None:
                self.speculator.forget(request_id)
        for beams in commit.continuations:
            self.scheduler.replace_beams(beams.parents, beams.children)

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached block (device and host tier); False, and nothing done,
        while a request holds blocks (vLLM's rule)."""
        manager = self.scheduler.kv_cache_manager
        if not manager.block_pool.reset_prefix_cache():
            return False
        if manager.host_tier is not None:
            manager.host_tier.clear()
        return True

    # -- metrics --

    def stats(self) -> EngineStats:
        speculator = self.speculator
        return EngineStats(
            self.scheduler.stats(),
            speculator.stats() if speculator is not None else SpecDecodeStats(0, 0, 0, []),
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.output_processor.generation_tokens,
            num_compilations=self.runner.num_compilations,
            weight_version=self.weight_version,
        )

    def get_metrics(self) -> dict[str, Any]:
        """Every metric by name (`metrics.EngineStats` says what each means)."""
        return self.stats().as_dict()
