"""The front end's output processor (vLLM V1's `OutputProcessor` in the API server):
turns an engine core's token-id deltas into the `RequestOutput`s readers see.

Owns, per request: incremental detokenization of each choice (`IncrementalDetokenizer`,
the one the in-process engine uses), stop strings (include_stop_str_in_output, the text
cut at a match, none before min_tokens tokens, tokens after the stopping one dropped),
the token texts of logprobs and prompt logprobs, and building outputs as the request
asked: cumulative, deltas (text that could still start a stop string held back), or
the finished output only. A request (or with n > 1 a choice) that a stop string ended
here is still running in its core: `process` says so, and the client aborts it there
(the core frees its blocks).
The engine core schedules, steps, and stops on EOS, stop token ids and lengths only
(`OutputProcessor.detokenize` off). Beam searches arrive whole, their text decoded by
the core, and pass through. Not owned: the sockets and routing (`client.py`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

from jvllm.engine.core.messages import WireOutput
from jvllm.engine.detokenizer import (
    IncrementalDetokenizer,
    build_token_pieces,
    decoder,
    stop_token_text_skipped,
)
from jvllm.lora.request import LoRARequest
from jvllm.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from jvllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams


class Processed(NamedTuple):
    output: RequestOutput | None  # for the request's reader (None: nothing to hand on)
    abort_in_core: bool  # stop strings ended it here, while its core still runs it
    # Choices a stop string ended here while others go on (n > 1), still running in
    # the core: it may end their sequences.
    ended_choices: list[int]


class TokenTexts:
    """Token id -> its text as a logprobs entry names it (`tokenizer.decode([id])`, as the
    in-process engine's), cached: the vocabulary's texts do not change."""

    def __init__(self, tokenizer: Any) -> None:
        self._decode = decoder(tokenizer)
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._decode([token_id], False)
        return text

    def name(self, position: PositionLogprobs | None) -> PositionLogprobs | None:
        """A position's logprobs with each token's text (the core sends none)."""
        if position is None:
            return None
        return {t: Logprob(lp.logprob, lp.rank, self(t)) for t, lp in position.items()}


class ChoiceState:
    """One sampled sequence (`CompletionOutput.index`) of a request, as its reader sees it."""

    def __init__(
        self,
        index: int,
        tokenizer: Any,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_ids: frozenset[int] = frozenset(),
    ) -> None:
        stops = params.stop_strings
        self.index = index
        # The EOS or stop token the core ended the choice on adds no text (as vLLM).
        self.silent_token_ids = stop_token_text_skipped(params, eos_token_ids)
        self.detok = IncrementalDetokenizer(
            tokenizer,
            prompt_token_ids,
            params.skip_special_tokens,
            stops,
            params.include_stop_str_in_output,
            params.min_tokens,
        )
        self.token_ids: list[int] = []
        self.logprobs: list[PositionLogprobs] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        # DELTA outputs: what earlier ones carried; text that could still start a stop
        # string waits (a match is cut from the text).
        self.sent_tokens = self.sent_chars = 0
        self.holdback = (  # none when a matched stop string stays in the text (vLLM)
            0 if params.include_stop_str_in_output else max((len(s) for s in stops), default=1) - 1
        )

    def add(self, delta: CompletionOutput, texts: TokenTexts) -> bool:
        """Takes the core's new tokens of this choice; True when a stop string ended it
        (tokens after the one that completed it are dropped)."""
        if self.finish_reason is not None:
            return False  # ended here by a stop string; the core ran on meanwhile
        tokens, logprobs = delta.token_ids, delta.logprobs
        if self.logprobs is not None and delta.cumulative_logprob is not None:
            self.cumulative_logprob = delta.cumulative_logprob  # the core's running sum
        for j, token in enumerate(tokens):
            self.token_ids.append(token)
            if self.logprobs is not None:
                assert logprobs is not None
                self.logprobs.append(texts.name(logprobs[j]) or {})
            last = j == len(tokens) - 1
            if last and delta.finish_reason == "stop" and token in self.silent_token_ids:
                break  # the core ended the choice on it: no text, no stop string
            matched = self.detok.append(token)
            if matched is not None:
                self.finish_reason, self.stop_reason = "stop", matched
                if self.logprobs is not None and logprobs is not None:
                    for dropped, position in zip(tokens[j + 1 :], logprobs[j + 1 :], strict=True):
                        self.cumulative_logprob -= position[dropped].logprob
                return True
        if delta.finish_reason is not None:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason
        return False

    def _cumulative(self) -> float | None:
        finite = self.logprobs is not None and math.isfinite(self.cumulative_logprob)
        return self.cumulative_logprob if finite else None

    def completion(self) -> CompletionOutput:
        """Everything so far (copies: a reader keeps each step's view)."""
        logprobs = None if self.logprobs is None else list(self.logprobs)
        return CompletionOutput(
            self.index,
            self.detok.output_text,
            list(self.token_ids),
            self._cumulative(),
            logprobs,
            self.finish_reason,
            self.stop_reason,
        )

    def delta(self) -> CompletionOutput:
        """What is new since the last delta (RequestOutputKind.DELTA)."""
        text, tokens, start = self.detok.output_text, self.token_ids, self.sent_tokens
        finished = self.finish_reason is not None
        visible = len(text) if finished else max(self.sent_chars, len(text) - self.holdback)
        out = CompletionOutput(
            self.index,
            text[self.sent_chars : visible],
            tokens[start:],
            self._cumulative(),
            None if self.logprobs is None else self.logprobs[start:],
            self.finish_reason,
            self.stop_reason,
        )
        self.sent_chars, self.sent_tokens = visible, len(tokens)
        return out


@dataclasses.dataclass
class RequestState:
    """A request's choices and what its reader has been sent (vLLM's `RequestState`)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    kind: RequestOutputKind
    lora_request: LoRARequest | None
    choices: list[ChoiceState]
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    sent_prompt_logprobs: bool = False
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    def output(self) -> RequestOutput | None:
        """This step's output for the request's kind (None: nothing for the reader)."""
        finished, prompt_logprobs = self.finished, self.prompt_logprobs
        if self.kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        if self.kind == RequestOutputKind.DELTA:
            if not finished and all(c.sent_tokens == len(c.token_ids) for c in self.choices):
                return None  # nothing new
            completions = [c.delta() for c in self.choices]
            if self.sent_prompt_logprobs:  # they go with the first output only
                prompt_logprobs = None
            self.sent_prompt_logprobs = True
        else:
            completions = [c.completion() for c in self.choices]
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            prompt_logprobs,
            completions,
            finished,
            self.num_cached_tokens,
            lora_request=self.lora_request,
        )


@dataclasses.dataclass
class _Beams:
    """A beam search: its whole output arrives once, with its text (decoded by the core)."""

    prompt: str | None
    prompt_token_ids: list[int]
    lora_request: LoRARequest | None


class FrontendOutputProcessor:
    """Every request of one front end in flight on its engine cores, by request id."""

    def __init__(self, tokenizer: Any, eos_token_ids: frozenset[int] = frozenset()) -> None:
        self.tokenizer = tokenizer
        build_token_pieces(tokenizer)
        self.eos_token_ids = eos_token_ids
        self.texts = TokenTexts(tokenizer)
        self.requests: dict[str, RequestState | _Beams] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams | BeamSearchParams,
        lora_request: LoRARequest | None,
    ) -> None:
        if isinstance(params, BeamSearchParams):
            self.requests[request_id] = _Beams(prompt, prompt_token_ids, lora_request)
            return
        choices = [
            ChoiceState(i, self.tokenizer, prompt_token_ids, params, self.eos_token_ids)
            for i in range(params.n)
        ]
        self.requests[request_id] = RequestState(
            request_id, prompt, prompt_token_ids, params.output_kind, lora_request, choices
        )

    def abort_request(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def process(self, wire: WireOutput) -> Processed:
        """One request's delta from its core: the reader's output, and whether the core
        must abort the request (every choice ended here, the core had not ended it)."""
        state = self.requests.get(wire.request_id)
        if state is None:
            return Processed(None, False, [])  # aborted here since
        if isinstance(state, _Beams):
            if wire.finished:
                del self.requests[wire.request_id]
            beams = RequestOutput(
                wire.request_id,
                state.prompt,
                state.prompt_token_ids,
                wire.prompt_logprobs,
                wire.outputs,
                wire.finished,
                wire.num_cached_tokens,
                lora_request=state.lora_request,
            )
            return Processed(beams, False, [])
        if wire.prompt_logprobs is not None and state.prompt_logprobs is None:
            state.prompt_logprobs = [self.texts.name(p) for p in wire.prompt_logprobs]
        state.num_cached_tokens = wire.num_cached_tokens
        ended = [
            delta.index
            for delta in wire.outputs
            if state.choices[delta.index].add(delta, self.texts) and delta.finish_reason is None
        ]
        output, finished = state.output(), state.finished
        if finished:
            del self.requests[wire.request_id]
            return Processed(output, not wire.finished, [])
        return Processed(output, False, ended)
