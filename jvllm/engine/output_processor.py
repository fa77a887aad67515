"""OutputProcessor: commits a step's sampled tokens to the requests that asked for them.

Owns the request states (`requests`: each user request's group, `sequences`: its live
sequences by scheduler id), the stop checks (EOS, stop token ids, stop strings,
max_tokens, max_model_len), incremental detokenization and logprobs (through
`SequenceState`), beam selection, and the `RequestOutput`s a step returns. It never
touches the scheduler: what the scheduler must learn (sequences that finished, beams
that continue) is in the `StepCommit` it returns, and the engine hands it on. It
does not verify drafts or propose them (`spec_decode.py`), nor tokenize prompts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from jvllm.engine.beam_search import Beam, BeamGroup, Candidates
from jvllm.engine.detokenizer import build_token_pieces
from jvllm.engine.request import Request, RequestStatus
from jvllm.engine.sequence_group import SequenceGroup, SequenceState
from jvllm.engine.spec_decode import StepSequence
from jvllm.engine.step_io import ScheduledRequest, SchedulerOutput, StepResult, StepRows
from jvllm.outputs import RequestOutput
from jvllm.sampling_params import RequestOutputKind


class BeamContinuation(NamedTuple):
    """A beam group's selection, for `Scheduler.replace_beams`."""

    parents: list[Request]
    children: list[tuple[Request, Request]]  # (child, the parent it continues)


class StepCommit(NamedTuple):
    """What committing one step produced, and what the scheduler must learn of it."""

    outputs: list[RequestOutput]
    finished: list[tuple[str, RequestStatus]]  # sequences to free, by scheduler id
    continuations: list[BeamContinuation]
    drafting: list[StepSequence]  # sequences to draft for (speculative decoding)


class SampledRows(NamedTuple):
    """Where a step's rows find their tokens in its `StepResult`."""

    at: Sequence[int]  # row i's first sampling row (1 + k for a row verifying k drafts)
    verified: dict[str, list[int]] | None  # tokens the rows with drafts emit


class OutputProcessor:
    def __init__(
        self,
        tokenizer: Any,
        eos_token_ids: frozenset[int],
        max_model_len: int,
        speculates: bool,
        drafts_every_row: bool,
    ) -> None:
        self.tokenizer = tokenizer
        if tokenizer is not None:
            build_token_pieces(tokenizer)
        # False in an engine core whose front end detokenizes (`engine/core/core.py`):
        # its sequences then carry token ids only (no text, no stop strings).
        self.detokenize = True
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.speculates = speculates  # rows of sequences without a grammar draft
        self.drafts_every_row = drafts_every_row  # prefill chunks too (an EAGLE head)
        self.requests: dict[str, SequenceGroup | BeamGroup] = {}  # user request id ->
        self.sequences: dict[str, SequenceState | Beam] = {}  # live, by scheduler id
        # Live sequences with a token mask, with bans that need the token just sampled
        # (a grammar, multi-token bad words), that score their prompt: most steps have
        # none, and a zero count skips the per-row check.
        self.num_masked = self.num_late = self.num_scoring = 0
        self.generation_tokens = 0
        self._finished: list[tuple[str, RequestStatus]] = []  # of the commit under way

    # -- requests in and out --

    def add_group(self, group: SequenceGroup) -> None:
        self.requests[group.request_id] = group
        alone = len(group.children) == 1 and group.params.output_kind is _CUMULATIVE
        for state in group.children:
            self.sequences[state.request.request_id] = state
            self._count(state, 1)
            state.streams_whole = alone

    def add_beam_group(self, group: BeamGroup) -> None:
        self.requests[group.request_id] = group
        (root,) = group.beams
        self.sequences[root.request.request_id] = root

    def _count(self, state: SequenceState, sign: int) -> None:
        self.num_masked += sign * state.constraints.masks
        self.num_late += sign * state.constraints.needs_latest_token
        self.num_scoring += sign * (state.prompt_logprobs is not None)

    @property
    def sequence_tokenizer(self) -> Any:
        """The tokenizer a new sequence detokenizes with (None: it does not)."""
        return self.tokenizer if self.detokenize else None

    def abort(self, request_id: str) -> StepCommit:
        """Ends every sequence of a request; its last output is in the commit."""
        self._finished = []
        group = self.requests.get(request_id)
        outputs = []
        if isinstance(group, BeamGroup):
            self._retire_beams(group, RequestStatus.FINISHED_ABORTED)
            outputs.append(group.output(self.tokenizer))
        elif group is not None:
            for state in group.children:
                if not state.finished:
                    self._finish(state, RequestStatus.FINISHED_ABORTED)
            outputs.append(self._retire(group))
        return StepCommit(outputs, self._finished, [], [])

    def abort_sequences(self, request_id: str, indices: Sequence[int]) -> StepCommit:
        """Ends some of a request's sequences (n > 1: choices an engine core's front end
        ended on a stop string); its last output is in the commit if that ended it."""
        self._finished = []
        group = self.requests.get(request_id)
        outputs = []
        if isinstance(group, SequenceGroup):
            for state in group.children:
                if state.index in indices and not state.finished:
                    self._finish(state, RequestStatus.FINISHED_ABORTED)
            if group.finished:
                outputs.append(self._retire(group))
        return StepCommit(outputs, self._finished, [], [])

    def forget_candidates(self, request_ids: Sequence[str]) -> None:
        """Preempted beams recompute and propose again."""
        for request_id in request_ids:
            state = self.sequences.get(request_id)
            if isinstance(state, Beam):
                state.candidates = None

    def states(self, rows: Sequence[ScheduledRequest]) -> list[SequenceState | Beam]:
        """Each row's sequence state (the scheduler's `StepRows`: read by request)."""
        sequences = self.sequences
        if isinstance(rows, StepRows):
            return [sequences[request.request_id] for request in rows.requests]
        return [sequences[row.request_id] for row in rows]

    def needs_previous_tokens(self, rows: Sequence[ScheduledRequest]) -> bool:
        """Whether some row's bans or grammar need the token the step before sampled."""
        if not self.num_late:
            return False
        sequences = self.sequences
        if isinstance(rows, StepRows):  # by request and previous row: no row made whole
            previous = rows.columns().prev_step_rows.tolist()
            return any(
                prev >= 0 and sequences[request.request_id].constraints.needs_latest_token
                for request, prev in zip(rows.requests, previous, strict=True)
            )
        return any(
            r.prev_step_row is not None and sequences[r.request_id].constraints.needs_latest_token
            for r in rows
        )

    # -- one step --

    def commit(
        self,
        sched: SchedulerOutput,
        states: Sequence[SequenceState | Beam],
        want_prompt: Sequence[bool],
        result: StepResult,
        sampled: SampledRows,
        final_only: bool,
    ) -> StepCommit:
        """Applies a step's tokens (already appended by the scheduler): stop checks,
        text, logprobs, beam candidates; returns the step's outputs."""
        self._finished = []
        outputs: list[RequestOutput] = []
        touched: dict[str, SequenceGroup] = {}  # requests of n > 1 sequences this step
        proposed: dict[str, BeamGroup] = {}
        drafting: list[StepSequence] = []
        rows = sched.scheduled
        # Rows other than steady decode rows, by index (a plain list: every row).
        whole = rows.whole if isinstance(rows, StepRows) else dict(enumerate(rows))
        inline = not self.speculates  # no drafts to verify or propose: plain rows inline
        num_inline = 0
        assert len(states) == len(want_prompt), (len(states), len(want_prompt))
        for i, state in enumerate(states):  # (indexing: no tuple per row, as zip's)
            wants = want_prompt[i]
            row = whole.get(i) if whole else None  # None: a steady decode row (one token)
            if inline and not wants and state.plain_commit and (row is None or row.samples):
                # Most rows: one token the scheduler appended, text and stop checks only
                # (`_add_tokens` for one token, without logprobs or a grammar).
                if state.finished:
                    continue  # stopped or aborted after this step was dispatched
                ids = state.request.output_token_ids
                token, num_out = ids[-1], len(ids)
                num_inline += 1
                if token in state.ending_token_ids or num_out >= state.max_output_tokens:
                    self._add_last_token(state, token, num_out)  # most tokens never do
                elif (matched := state.detok.append(token)) is not None:
                    state.matched_stop = matched
                    self._check_stop(state, num_out)
            elif isinstance(state, Beam):
                row = rows[i] if row is None else row
                # Preempted since dispatch: not awaiting selection, it proposes again.
                if not state.finished and row.samples and state.request.awaiting_selection:
                    group = self.requests[state.group_id]
                    assert isinstance(group, BeamGroup)
                    state.candidates = self._candidates(result, i, group)
                    proposed[state.group_id] = group
                continue
            else:
                if state.finished:
                    continue  # stopped or aborted after this step was dispatched
                row = rows[i] if row is None else row
                if wants:
                    assert result.prompt_logprobs is not None
                    state.add_prompt_logprobs(row, result.prompt_logprobs[i])
                self._commit_row(state, row, result, sampled, i, drafting)
            group = state.group
            assert group is not None
            if len(group.children) > 1:
                touched[group.request_id] = group  # its output once all its rows are in
            elif state.finished:
                outputs.append(self._retire(group, final_only))
            elif not final_only:
                out = state.whole_output() if state.streams_whole else state.own_output()
                if out is not None:  # None: FINAL_ONLY, or a DELTA with nothing new
                    outputs.append(out)
        self.generation_tokens += num_inline
        continuations: list[BeamContinuation] = []
        for beams in proposed.values():
            if (out := self._select(beams, continuations)) is not None:
                outputs.append(out)
        for group in touched.values():
            if group.finished:
                outputs.append(self._retire(group, final_only))
            elif not final_only and (out := group.output()) is not None:
                outputs.append(out)
        return StepCommit(outputs, self._finished, continuations, drafting)

    def _commit_row(
        self,
        state: SequenceState,
        row: ScheduledRequest,
        result: StepResult,
        sampled: SampledRows,
        i: int,
        drafting: list[StepSequence],
    ) -> None:
        """One sequence's tokens of the step, and whether it drafts next."""
        at = sampled.at[i]
        speculates = self.speculates and state.constraints.grammar is None
        if not row.samples:
            if speculates and self.drafts_every_row:  # a prefill chunk
                drafting.append(StepSequence(state.request, state.seed, at, False))
            return
        num = 1
        if sampled.verified and row.num_spec_tokens:
            num = len(sampled.verified[row.request_id])
        self._add_tokens(state, result, at, num)
        if speculates and not state.finished:
            # The newest token came from the row's num-th logits row.
            drafting.append(StepSequence(state.request, state.seed, at + num - 1, True))

    def _add_tokens(self, state: SequenceState, result: StepResult, at: int, num: int) -> None:
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

    def _add_last_token(self, state: SequenceState, token: int, num_out: int) -> None:
        """A plain row's token that may end its sequence (a stop or EOS token, or the
        last the length allows): `SequenceState.add_token`'s text, then the stop check."""
        if token in state.silent_token_ids and num_out >= state.min_tokens:
            state.matched_stop = None  # it ends the output, textless
        else:
            state.matched_stop = state.detok.append(token)
        self._check_stop(state, num_out)

    def _candidates(self, result: StepResult, row: int, group: BeamGroup) -> Candidates:
        k = group.num_candidates
        return Candidates(result.top_ids[row][:k].tolist(), result.top_logprobs[row][:k].tolist())

    def _select(
        self, group: BeamGroup, continuations: list[BeamContinuation]
    ) -> RequestOutput | None:
        """Advances a beam search whose live beams have all proposed; its output once done."""
        if not group.ready:
            return None
        chosen, done = group.select()
        if done:
            self._retire_beams(group, RequestStatus.FINISHED_STOPPED)
            return group.output(self.tokenizer)
        parents = group.beams
        children = group.continue_with(chosen)
        pairs = [(b.request, c.parent.request) for b, c in zip(children, chosen, strict=True)]
        continuations.append(BeamContinuation([p.request for p in parents], pairs))
        for parent in parents:
            parent.finished = True
            del self.sequences[parent.request.request_id]
        for beam in children:
            self.sequences[beam.request.request_id] = beam
        self.generation_tokens += len(children)
        return None

    def _retire_beams(self, group: BeamGroup, status: RequestStatus) -> None:
        for beam in group.beams:
            beam.finished = True
            del self.sequences[beam.request.request_id]
            self._finished.append((beam.request.request_id, status))
        del self.requests[group.request_id]

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
        """Ends a sequence: its output says why; the scheduler frees its blocks."""
        state.finish(status, stop_reason)
        self._finished.append((state.request.request_id, status))

    def _retire(self, group: SequenceGroup, final_only: bool = False) -> RequestOutput:
        del self.requests[group.request_id]
        for state in group.children:
            del self.sequences[state.request.request_id]
            self._count(state, -1)
        out = group.output(final_only)
        assert out is not None  # a finished group always has its last output
        return out


_CUMULATIVE = RequestOutputKind.CUMULATIVE
