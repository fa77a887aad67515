"""Turning cumulative engine outputs into stream deltas, one cursor per choice.

Owns what has already been sent of each choice. Text that could still become the
start of a stop string is held back until the choice finishes: the engine cuts a
matched stop string out of its cumulative text, and a stream cannot take back text
it already sent. Holding back `len(longest stop) - 1` characters is enough, since
a match not seen in the previous text must end past it.
"""

from __future__ import annotations

from dataclasses import dataclass

from jvllm.outputs import CompletionOutput
from jvllm.sampling_params import BeamSearchParams, SamplingParams


@dataclass(frozen=True)
class Delta:
    text: str
    token_start: int  # new tokens are token_ids[token_start:token_end]
    token_end: int
    finish_reason: str | None
    stop_reason: int | str | None


@dataclass
class ChoiceCursor:
    holdback: int = 0
    sent_chars: int = 0
    sent_tokens: int = 0
    finished: bool = False

    @classmethod
    def for_params(cls, params: SamplingParams | BeamSearchParams) -> ChoiceCursor:
        # A beam search has no stop strings: its whole text arrives when it finishes.
        stops = params.stop_strings if isinstance(params, SamplingParams) else []
        return cls(holdback=max(len(s) for s in stops) - 1 if stops else 0)

    def advance(self, output: CompletionOutput) -> Delta | None:
        """What is new since the last call; None once the finish was already sent."""
        if self.finished:
            return None
        text, end = output.text, len(output.token_ids)
        if output.finish_reason is None:
            visible = max(self.sent_chars, len(text) - self.holdback)
        else:
            visible = len(text)
            self.finished = True
        delta = Delta(
            text[self.sent_chars : visible],
            self.sent_tokens,
            end,
            output.finish_reason,
            output.stop_reason,
        )
        self.sent_chars, self.sent_tokens = max(self.sent_chars, visible), end
        return delta

    @staticmethod
    def is_empty(delta: Delta, with_tokens: bool) -> bool:
        """Nothing to send: no text, no finish, and no new tokens the client asked to see."""
        new_tokens = with_tokens and delta.token_end > delta.token_start
        return not delta.text and delta.finish_reason is None and not new_tokens
