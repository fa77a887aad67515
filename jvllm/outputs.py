"""What the engine hands back: RequestOutput, CompletionOutput and Logprob (vLLM's shapes)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jvllm.lora.request import LoRARequest


@dataclass(frozen=True)
class Logprob:
    logprob: float
    rank: int | None = None  # 1-based rank among the vocabulary (None when unknown)
    decoded_token: str | None = None


# One position's logprobs: token id -> Logprob (the chosen token plus the top-N).
PositionLogprobs = dict[int, Logprob]


# slots: one of each is built per running request and step (no instance dict to
# make and free).
@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: dict[str, float] | None = None  # vLLM's field; jvllm reports none per request
    lora_request: LoRARequest | None = None  # the adapter it ran with (None: the base model)

    def add(self, later: RequestOutput) -> None:
        """Folds a later DELTA output of the same request into this one (a reader that
        fell behind gets every new token once)."""
        mine = {c.index: c for c in self.outputs}
        for c in later.outputs:
            if c.index not in mine:
                self.outputs.append(c)
                continue
            base = mine[c.index]
            base.text += c.text
            base.token_ids = [*base.token_ids, *c.token_ids]
            if base.logprobs is not None and c.logprobs is not None:
                base.logprobs = [*base.logprobs, *c.logprobs]
            base.cumulative_logprob = c.cumulative_logprob
            base.finish_reason, base.stop_reason = c.finish_reason, c.stop_reason
        self.prompt_logprobs = self.prompt_logprobs or later.prompt_logprobs
        self.finished = later.finished
