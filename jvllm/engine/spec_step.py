"""The order of one engine step with speculative decoding and async scheduling on.

Owns `overlapped_step`, which `LLMEngine.step` runs when a speculator is set and
`async_scheduling` is on: the verdict of step N first, its commit last. It waits for
step N's sampled tokens, verifies the drafts (`spec_decode.verify`), gives the
scheduler the emitted tokens (`update_from_output`, which rolls rejected drafts back)
and queues the proposal after N; then it schedules, packs and queues step N + 1 (the
proposal's drafts fed on the device, `spec_in_flight.py`); only then does the output
processor commit N (stop checks, text, logprobs, outputs) while N + 1 runs on the
device. Without async scheduling the engine commits each step before the next one is
scheduled, as `LLMEngine.step` does.

The host still reads N's tokens before it schedules N + 1: each row of N + 1 sits at
the length its request has after N's verdict, so nothing on the device is rolled back.
What trails by one step is the commit: a request that stopped in N (a stop token or
string) may have a row in N + 1, dropped unseen at its commit as the plain async order
drops it (`Scheduler._schedule_running` skips a request whose tokens end it by length);
its drafts count in no metric. Rows whose grammar needs N's token commit N first.

Not owned: the synchronous order and each piece it calls (`llm_engine.py`), choosing
and verifying drafts (`spec_decode.py`), stop checks (`output_processor.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from jvllm.engine.beam_search import Beam
from jvllm.engine.output_processor import SampledRows
from jvllm.engine.sequence_group import SequenceState
from jvllm.engine.spec_decode import Speculator, StepSequence, verify
from jvllm.engine.step_io import ScheduledRequest, StepResult
from jvllm.outputs import RequestOutput

if TYPE_CHECKING:
    from jvllm.engine.llm_engine import LLMEngine, _InFlight

# The methods whose steps overlap this way (every one: each proposal reads only the
# tokens the scheduler holds after the verdict, on the host or on the device).
OVERLAPPED_METHODS = frozenset(
    {"ngram", "draft_model", "eagle", "eagle3", "deepseek_mtp", "medusa"}
)


class Verdict(NamedTuple):
    """A step whose tokens the scheduler has, waiting for the output processor."""

    flight: _InFlight
    result: StepResult
    sampled: SampledRows


def overlapped_step(engine: LLMEngine, final_only: bool) -> list[RequestOutput]:
    """One `LLMEngine.step` with a speculator: N's verdict, N + 1 queued, N committed."""
    outputs, engine._aborted_outputs = engine._aborted_outputs, []
    previous, engine._in_flight = engine._in_flight, None
    verdict = take_verdict(engine, previous) if previous is not None else None
    sched = engine.scheduler.schedule()
    engine.output_processor.forget_candidates(sched.preempted_request_ids)
    engine._queue_block_moves(sched)
    if sched.scheduled:
        sched, prepared = engine._forward(sched)
        if verdict is not None and _needs_commit_first(engine, prepared.states):
            outputs += commit_verdict(engine, verdict, final_only)  # a grammar's next mask
            verdict = None
        engine._in_flight = engine._sample(prepared)
    else:
        engine.scheduler.update_from_output(sched, {})
    if verdict is not None:
        outputs += commit_verdict(engine, verdict, final_only)
    return engine._once_sent(outputs)


def take_verdict(engine: LLMEngine, flight: _InFlight) -> Verdict:
    """Waits for a dispatched step, verifies its drafts, gives the scheduler its tokens
    and queues the proposal after it; the output processor's part comes later."""
    speculator = engine.speculator
    assert speculator is not None
    result = flight.pending.result()
    rows = flight.sched.scheduled
    sampled = SampledRows(range(len(rows)), None)
    if any(row.num_spec_tokens for row in rows):
        sampled = verify_rows(speculator, rows, flight.states, result)
    tokens = result.token_ids.tolist()  # one conversion, not one per row
    if sampled.verified is not None:  # row i's token is at its first sampling row
        tokens = [tokens[a] for a in sampled.at]
    engine.scheduler.update_from_output(flight.sched, tokens, sampled.verified)
    every_row = engine.output_processor.drafts_every_row
    speculator.propose(drafting(rows, flight.states, sampled, every_row))
    return Verdict(flight, result, sampled)


def commit_verdict(engine: LLMEngine, verdict: Verdict, final_only: bool) -> list[RequestOutput]:
    """The output processor's commit of a step whose tokens the scheduler has."""
    flight = verdict.flight
    commit = engine.output_processor.commit(
        flight.sched, flight.states, flight.want_prompt, verdict.result, verdict.sampled, final_only
    )
    engine._apply(commit)  # its `drafting` was proposed for already (`take_verdict`)
    return commit.outputs


def verify_rows(
    speculator: Speculator,
    rows: Sequence[ScheduledRequest],
    states: Sequence[SequenceState | Beam],
    result: StepResult,
) -> SampledRows:
    """Each row's first sampling row and what the rows with drafts emit; the counters
    leave out rows of sequences that finished after their step was dispatched."""
    at: list[int] = []
    verified: dict[str, list[int]] = {}
    next_at = 0
    for row, state in zip(rows, states, strict=True):
        at.append(next_at)
        k = row.num_spec_tokens
        if k and row.samples:
            drawn = result.token_ids[next_at : next_at + 1 + k]
            verified[row.request_id] = emitted = verify(row.token_ids[-k:], drawn)
            if not state.finished:
                speculator.observe(k, emitted)
        next_at += 1 + k
    return SampledRows(at, verified)


def drafting(
    rows: Sequence[ScheduledRequest],
    states: Sequence[SequenceState | Beam],
    sampled: SampledRows,
    every_row: bool,
) -> list[StepSequence]:
    """The sequences to draft for after a step, before its stop checks (as
    `OutputProcessor._commit_row` picks them): every sampled row's, and with `every_row`
    each prefill chunk's; never a beam's, a finished sequence's or a grammar's."""
    out: list[StepSequence] = []
    for i, (row, state) in enumerate(zip(rows, states, strict=True)):
        if isinstance(state, Beam) or state.finished or state.constraints.grammar is not None:
            continue
        at = sampled.at[i]
        if not row.samples:
            if every_row:  # a prefill chunk short of the prompt's end
                out.append(StepSequence(state.request, state.seed, at, False))
            continue
        num = 1
        if sampled.verified is not None and row.num_spec_tokens:
            num = len(sampled.verified[row.request_id])
        # The newest token came from the row's num-th logits row.
        out.append(StepSequence(state.request, state.seed, at + num - 1, True))
    return out


def _needs_commit_first(engine: LLMEngine, states: Sequence[SequenceState | Beam]) -> bool:
    """Whether some row's mask needs the output processor's view of the step before
    (a grammar advances there); bans read the scheduler's tokens, which it has."""
    if not engine.output_processor.num_late:
        return False
    return any(isinstance(s, SequenceState) and s.constraints.grammar is not None for s in states)
