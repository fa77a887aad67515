"""Per-request output state: one SequenceState per sampled sequence, grouped per request.

Owns what a user sees of a request: decoded text, token ids, logprobs, prompt
logprobs, finish reasons, and assembling `RequestOutput`. A request with `n > 1`
is a group of n sibling sequences that the scheduler runs as separate requests.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from jvllm.engine.detokenizer import (
    IncrementalDetokenizer,
    TokenIdsOnly,
    decoder,
    stop_token_text_skipped,
)
from jvllm.engine.request import Request, RequestStatus
from jvllm.engine.step_io import SamplingRow, ScheduledRequest, StepResult
from jvllm.engine.token_constraints import Constraints
from jvllm.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from jvllm.sampling_params import RequestOutputKind, SamplingParams


class SequenceState:
    def __init__(
        self,
        request: Request,
        index: int,
        seed: int,
        tokenizer: Any,
        eos_token_ids: frozenset[int],
        max_output_tokens: int,
        constraints: Constraints | None = None,
    ) -> None:
        """The EOS ids and the stop token ids (whatever min_tokens and ignore_eos say)
        are the tokens that may end the sequence, and `max_output_tokens` the output
        length that does: the engine's stop check looks closer only at those
        (`add_token`)."""
        params = request.sampling_params
        self.request = request
        self.index = index
        self.seed = seed
        self.group: SequenceGroup | None = None  # set when its group adds it
        # No tokenizer: an engine core's sequence, which its front end detokenizes (no
        # text, stop strings nor logprob token texts here).
        self._decode_ids = decoder(tokenizer) if tokenizer is not None else _no_text
        self.detok = (
            IncrementalDetokenizer(
                tokenizer,
                request.prompt_token_ids,
                params.skip_special_tokens,
                params.stop_strings,
                params.include_stop_str_in_output,
                params.min_tokens,
            )
            if tokenizer is not None
            else TokenIdsOnly()
        )
        self.cumulative_logprob = 0.0
        self.logprobs: list[PositionLogprobs] | None = [] if params.logprobs is not None else None
        # Position 0 has no logprob: nothing precedes it.
        self.prompt_logprobs: list[PositionLogprobs | None] | None = (
            [None] if params.prompt_logprobs is not None and index == 0 else None
        )
        self.matched_stop: str | None = None
        # Set once, when the engine finishes the sequence; the scheduler gets the same.
        self.finished_status: RequestStatus | None = None
        self.finished = False  # finished_status is not None (read per row and step)
        self.stop_reason: int | str | None = None
        self.constraints = constraints or Constraints()
        # From this output count on, a row bans nothing (min_tokens reached, no bad
        # words): `sampling_row`'s short path.
        self._bans_until = params.min_tokens if self.constraints.bad_words is None else math.inf
        # The sampler needs only its constants, seed and step index (`SamplingBatch`),
        # never a whole `sampling_row`.
        self.plain_sampling = not (
            params.uses_penalties or params.logit_bias or self._bans_until or self.constraints.masks
        )
        # Its tokens need no more than text and the stop checks (no logprobs, no grammar):
        # the output processor commits them inline (`OutputProcessor.commit`).
        self.plain_commit = self.logprobs is None and self.constraints.grammar is None
        self.ending_token_ids = eos_token_ids | frozenset(params.stop_token_ids)
        # As vLLM: the EOS or stop token that ends the output adds no text unless
        # include_stop_str_in_output (from min_tokens on, where it ends it).
        self.silent_token_ids = stop_token_text_skipped(params, eos_token_ids)
        self.min_tokens = params.min_tokens
        self.max_output_tokens = max_output_tokens
        # DELTA outputs: how much of the tokens and text earlier outputs carried; text
        # that could still start a stop string waits (the engine cuts a matched one).
        self.sent_tokens = self.sent_chars = 0
        # Its request is this sequence alone and wants CUMULATIVE outputs (set when the
        # output processor adds the group): `whole_output()` is its output every step.
        self.streams_whole = False
        self.holdback = (  # none when a matched stop string stays in the text (vLLM)
            0
            if params.include_stop_str_in_output
            else max((len(s) for s in params.stop_strings), default=1) - 1
        )

    def finish(self, status: RequestStatus, stop_reason: int | str | None = None) -> None:
        assert status.is_finished, status
        self.finished_status, self.stop_reason = status, stop_reason
        self.finished = True

    def sampling_row(
        self,
        eos_token_ids: frozenset[int],
        row: ScheduledRequest,
        drafts: list[int] | None = None,
        draft: tuple[int, int] | None = None,
    ) -> SamplingRow:
        """The sampler's view of this sequence for a scheduled row that samples; with
        `drafts`, for the position after them (the row verifies draft tokens, and these
        are the ones before that position, as if accepted). `draft` is the (token, q
        row) a draft model proposed for this position."""
        r = self.request
        # Tokens sampled before this row's (its own placeholder is already counted).
        placeholders = r.num_output_placeholders
        outputs = r.output_token_ids
        step_index = len(outputs) + placeholders - 1
        # Placeholders: this row's own sample, and the previous step's if uncommitted.
        pending = row.prev_step_row is not None and placeholders > 1
        if step_index >= self._bans_until and drafts is None and draft is None:
            # Most rows: nothing banned, no drafts.
            return SamplingRow(
                r.sampling_params,
                self.seed,
                step_index,
                r.prompt_token_ids,
                outputs,
                pending_output=pending,
            )
        params = r.sampling_params
        if drafts:
            step_index += len(drafts)
            outputs = outputs + drafts
        banned: Sequence[int] = ()  # most rows ban nothing: no list built for them
        if step_index < params.min_tokens:
            # As vLLM: until min_tokens, neither a stop token nor EOS can be chosen.
            banned = list(params.stop_token_ids)
            if not params.ignore_eos:
                banned += sorted(eos_token_ids)
        bad_words = self.constraints.bad_words
        if bad_words is not None:
            # Multi-token words need the latest token: the engine commits it first.
            assert not (pending and bad_words.needs_history), r
            banned = [*banned, *bad_words.banned(outputs)]
        draft_token, q_row = draft if draft is not None else (-1, -1)
        return SamplingRow(
            params,
            self.seed,
            step_index,
            r.prompt_token_ids,
            outputs,
            banned_token_ids=banned,
            pending_output=pending,
            draft_token_id=draft_token,
            draft_q_row=q_row,
        )

    def add_token(self, result: StepResult, row: int, token: int, num_out: int) -> bool:
        """Records `token`, the one the scheduler appended from `result` (the runner's
        StepResult) at its sampling row `row`, the output's `num_out`-th. False when it
        certainly ends nothing (most tokens): no stop or EOS token, below the length
        limit, no stop string matched and no grammar to finish; else the engine's stop
        check looks closer."""
        if self.logprobs is not None:
            # As vLLM: logprobs (and so the cumulative one) only when the request asks.
            logprob = float(result.logprobs[row])
            self.cumulative_logprob += logprob
            top = self.request.sampling_params.logprobs
            ids, lps = result.top_ids[row][:top], result.top_logprobs[row][:top]
            self.logprobs.append(self._position(token, logprob, ids, lps))
        if token in self.silent_token_ids and num_out >= self.min_tokens:
            self.matched_stop = matched = None  # it ends the output, without its text
        else:
            self.matched_stop = matched = self.detok.append(token)
        grammar = self.constraints.grammar
        if grammar is not None:
            grammar.accept(token)
        return (
            token in self.ending_token_ids
            or num_out >= self.max_output_tokens
            or matched is not None
            or grammar is not None
        )

    def wants_prompt_logprobs(self, row: ScheduledRequest) -> bool:
        if self.prompt_logprobs is None:
            return False
        # This row's logits at position p score prompt token p + 1.
        return len(self.prompt_logprobs) < self.request.num_prompt_tokens and (
            row.start_position + len(row.token_ids) >= len(self.prompt_logprobs)
        )

    def prompt_targets(self, row: ScheduledRequest) -> list[int]:
        """The prompt token each of the row's positions predicts (0 past the prompt)."""
        prompt = self.request.prompt_token_ids
        ends = range(row.start_position + 1, row.start_position + len(row.token_ids) + 1)
        return [prompt[p] if p < len(prompt) else 0 for p in ends]

    def add_prompt_logprobs(self, row: ScheduledRequest, scored: Any) -> None:
        """scored: the runner's `PromptLogprobs` of the row's new positions, whose
        targets were `prompt_targets(row)`."""
        assert self.prompt_logprobs is not None
        prompt = self.request.prompt_token_ids
        top = self.request.sampling_params.prompt_logprobs or 0
        for j in range(len(row.token_ids)):
            target = row.start_position + j + 1
            if target != len(self.prompt_logprobs) or target >= len(prompt):
                continue  # already recorded (a recompute) or past the prompt
            token, logprob = prompt[target], float(scored.target_logprobs[j])
            ids, lps = scored.top_ids[j][:top], scored.top_logprobs[j][:top]
            entry = self._position(token, logprob, ids, lps)
            entry[token] = Logprob(logprob, int(scored.target_ranks[j]), self._decode(token))
            self.prompt_logprobs.append(entry)

    def _position(
        self, token: int, logprob: float, top_ids: np.ndarray, top_lps: np.ndarray
    ) -> PositionLogprobs:
        entry = {
            int(t): Logprob(float(lp), rank + 1, self._decode(int(t)))
            for rank, (t, lp) in enumerate(zip(top_ids, top_lps, strict=True))
        }
        if token not in entry:
            entry[token] = Logprob(logprob, None, self._decode(token))
        return {token: entry.pop(token), **entry}  # the chosen token first

    def _decode(self, token: int) -> str | None:
        return self._decode_ids([token], False)

    def delta(self) -> CompletionOutput:
        """What is new since the last delta (RequestOutputKind.DELTA)."""
        text, tokens = self.detok.output_text, self.request.output_token_ids
        status, logprobs = self.finished_status, self.logprobs
        visible = len(text) if status else max(self.sent_chars, len(text) - self.holdback)
        start = self.sent_tokens
        out = CompletionOutput(
            self.index,
            text[self.sent_chars : visible],
            tokens[start:],
            None if logprobs is None else self._cumulative_logprob(),
            None if logprobs is None else logprobs[start:],
            status.finish_reason if status else None,
            self.stop_reason,
        )
        self.sent_chars, self.sent_tokens = visible, len(tokens)
        return out

    @property
    def num_outputs(self) -> int:
        return len(self.request.output_token_ids)

    def _cumulative_logprob(self) -> float | None:
        finite = self.logprobs is not None and math.isfinite(self.cumulative_logprob)
        return self.cumulative_logprob if finite else None

    def own_output(self, final_only: bool = False) -> RequestOutput | None:
        """`SequenceGroup.output()` of a request that is this sequence alone: everything
        so far (CUMULATIVE), what is new (DELTA; None when nothing is), or, before it
        finishes, None (FINAL_ONLY, and the offline API's `final_only`)."""
        group = self.group
        assert group is not None
        kind = group.params.output_kind
        if final_only or kind is _FINAL_ONLY:
            return None if self.finished_status is None else self.whole_output()
        return self.delta_output() if kind is _DELTA else self.whole_output()

    def whole_output(self) -> RequestOutput:
        """`own_output()` of a CUMULATIVE request (most requests, every step) in one call:
        `completion()` and `_output()` written out here (a call each costs ~2% of a
        request's host work in a decode step)."""
        group, request, status = self.group, self.request, self.finished_status
        assert group is not None
        completion = CompletionOutput(
            self.index,
            self.detok.output_text,
            request.output_token_ids,
            None if self.logprobs is None else self._cumulative_logprob(),
            self.logprobs,
            status.finish_reason if status is not None else None,
            self.stop_reason,
        )
        return RequestOutput(
            group.request_id,
            group.prompt,
            group.prompt_token_ids,
            self.prompt_logprobs,
            [completion],
            status is not None,
            request.num_cached_tokens or 0,
            None,  # metrics
            request.lora_request,
        )

    def delta_output(self) -> RequestOutput | None:
        """`own_output()` of a DELTA request (what streaming clients get, every step) in
        one call: `delta()` and `_output()` written out here; None when nothing is new."""
        group, request, status = self.group, self.request, self.finished_status
        assert group is not None
        tokens, start = request.output_token_ids, self.sent_tokens
        if status is None and start == len(tokens):
            return None
        text, sent_chars, logprobs = self.detok.output_text, self.sent_chars, self.logprobs
        visible = len(text) if status else max(sent_chars, len(text) - self.holdback)
        completion = CompletionOutput(
            self.index,
            text[sent_chars:visible],
            tokens[start:],
            None if logprobs is None else self._cumulative_logprob(),
            None if logprobs is None else logprobs[start:],
            status.finish_reason if status is not None else None,
            self.stop_reason,
        )
        self.sent_chars, self.sent_tokens = visible, len(tokens)
        # Prompt logprobs go with the first output only.
        prompt_logprobs = None if group.sent_prompt_logprobs else self.prompt_logprobs
        group.sent_prompt_logprobs = True
        return RequestOutput(
            group.request_id,
            group.prompt,
            group.prompt_token_ids,
            prompt_logprobs,
            [completion],
            status is not None,
            request.num_cached_tokens or 0,
            None,  # metrics
            request.lora_request,
        )

    def completion(self) -> CompletionOutput:
        """Everything so far. As vLLM's, its token ids and logprobs are the sequence's own
        lists, which later steps extend (no copy of the whole output per step): copy them
        to keep one step's view; the text is that step's."""
        status = self.finished_status
        return CompletionOutput(
            self.index,
            self.detok.output_text,
            self.request.output_token_ids,
            None if self.logprobs is None else self._cumulative_logprob(),
            self.logprobs,
            status.finish_reason if status is not None else None,
            self.stop_reason,
        )


@dataclass
class SequenceGroup:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    children: list[SequenceState] = field(default_factory=list)
    sent_prompt_logprobs: bool = False  # DELTA: the first output carried them

    @property
    def child_ids(self) -> list[str]:
        return [c.request.request_id for c in self.children]

    def add(self, state: SequenceState) -> None:
        self.children.append(state)
        state.group = self

    @property
    def finished(self) -> bool:
        children = self.children
        if len(children) == 1:  # the common case, checked per request and step
            return children[0].finished_status is not None
        return all(child.finished_status is not None for child in children)

    def output(self, final_only: bool = False) -> RequestOutput | None:
        """This step's output for the request's `output_kind`: everything so far, what is
        new (None when nothing is), or, before it finishes, None (FINAL_ONLY). With
        `final_only` (the offline API) the whole result, once finished."""
        kind, children = self.params.output_kind, self.children
        if len(children) == 1:
            return children[0].own_output(final_only)
        prompt_logprobs = children[0].prompt_logprobs
        finished = self.finished
        if kind == _DELTA and not final_only:
            if not finished and all(c.sent_tokens == c.num_outputs for c in children):
                return None  # nothing new
            completions = [c.delta() for c in children]
            if self.sent_prompt_logprobs:  # they go with the first output only
                prompt_logprobs = None
            self.sent_prompt_logprobs = True
        elif (final_only or kind == _FINAL_ONLY) and not finished:
            return None
        else:
            completions = [c.completion() for c in children]
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            prompt_logprobs,
            completions,
            finished,
            children[0].request.num_cached_tokens or 0,
            None,  # metrics
            children[0].request.lora_request,
        )


def _no_text(ids: list[int], skip_special_tokens: bool) -> None:
    return None


# Read once per request and step: module constants, not attributes of the enum class.
_DELTA, _FINAL_ONLY = RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY
