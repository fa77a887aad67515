"""Request timing: the latencies and sizes a server's metrics observe, per request.

Owns what is measured and when, from the engine's outputs as the engine thread sees them:
queue time (arrival to the first step that schedules the request), time to first token,
inter-token latency, end to end, and, when a request finishes, the per-request figures
vLLM's metrics report (prefill, decode and inference time, mean time per output token,
prompt and generation tokens, n, max_tokens, the finish reason). Does not own the
histograms (`jvllm.server.metrics`), nor the engine loop (`AsyncLLM`, which calls
`RequestTiming.on_output` for every output of a timed request). Host only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from jvllm.outputs import RequestOutput

# Names passed to LatencyObserver.observe, one per latency histogram.
QUEUE_TIME, TTFT, ITL, E2E = "queue_time", "time_to_first_token", "inter_token_latency", "e2e"


@dataclass(frozen=True)
class FinishedRequestStats:
    """One finished request, as vLLM's FinishedRequestStats (seconds and token counts)."""

    finish_reason: str  # "stop", "length" or "abort"
    num_prompt_tokens: int
    num_generation_tokens: int  # over all n sequences
    e2e_latency: float  # arrival to finish
    queued_time: float  # arrival to first scheduled
    prefill_time: float  # first scheduled to first token
    decode_time: float  # first token to finish
    inference_time: float  # first scheduled to finish
    mean_time_per_output_token: float  # decode_time / (tokens after the first); 0 for one
    n: int
    max_tokens: int | None


class LatencyObserver(Protocol):
    def observe(self, name: str, seconds: float) -> None:
        """Called on the engine thread with one of QUEUE_TIME, TTFT, ITL, E2E."""

    def finished(self, stats: FinishedRequestStats) -> None:
        """Called on the engine thread once per request that finishes."""


@dataclass
class RequestTiming:
    arrival: float
    n: int = 1
    max_tokens: int | None = None
    delta: bool = False  # RequestOutputKind.DELTA: each output carries only new tokens
    final_only: bool = False  # RequestOutputKind.FINAL_ONLY: the stream gets the last one
    scheduled_at: float | None = None  # the start of the first step that scheduled it
    first_token: float | None = None
    last_token: float | None = None
    num_tokens: int = 0  # generated so far, over all sequences

    @property
    def scheduled(self) -> bool:
        return self.scheduled_at is not None

    def on_output(
        self, output: RequestOutput, step_start: float, now: float, observer: LatencyObserver
    ) -> bool:
        """Observes what this output tells; whether the request's stream wants it."""
        if self.scheduled_at is None:
            self.scheduled_at = step_start
            observer.observe(QUEUE_TIME, step_start - self.arrival)
        completions = output.outputs if isinstance(output.outputs, list) else ()  # pooling: none
        num_tokens = sum(len(c.token_ids) for c in completions)
        if self.delta:
            num_tokens += self.num_tokens  # a delta's tokens come on top of earlier ones
        if num_tokens > self.num_tokens:
            if self.last_token is None:
                observer.observe(TTFT, now - self.arrival)
                self.first_token = now
            else:
                observer.observe(ITL, now - self.last_token)
            self.last_token, self.num_tokens = now, num_tokens
        if output.finished:
            observer.observe(E2E, now - self.arrival)
            observer.finished(self._finished_stats(output, now))
            return True
        return not self.final_only

    def aborted(self, now: float) -> FinishedRequestStats:
        """The stats of a request aborted before it finished (its prompt size unknown)."""
        return self._stats("abort", 0, now)

    def _finished_stats(self, output: RequestOutput, now: float) -> FinishedRequestStats:
        completions = output.outputs if isinstance(output.outputs, list) else ()
        reasons = [c.finish_reason for c in completions if c.finish_reason]
        reasons = reasons or ([] if completions else ["stop"])  # a pooling request: done
        reason = reasons[0] if reasons else "abort"
        return self._stats(reason, len(output.prompt_token_ids or ()), now)

    def _stats(self, reason: str, num_prompt_tokens: int, now: float) -> FinishedRequestStats:
        scheduled = self.scheduled_at if self.scheduled_at is not None else now
        first = self.first_token if self.first_token is not None else now
        decode = now - first
        return FinishedRequestStats(
            finish_reason=reason,
            num_prompt_tokens=num_prompt_tokens,
            num_generation_tokens=self.num_tokens,
            e2e_latency=now - self.arrival,
            queued_time=scheduled - self.arrival,
            prefill_time=first - scheduled,
            decode_time=decode,
            inference_time=now - scheduled,
            mean_time_per_output_token=decode / (self.num_tokens - 1)
            if self.num_tokens > 1
            else 0.0,
            n=self.n,
            max_tokens=self.max_tokens,
        )


class NoObserver:
    """Observes nothing (AsyncLLM without a server's metrics)."""

    def observe(self, name: str, seconds: float) -> None:
        pass

    def finished(self, stats: FinishedRequestStats) -> None:
        pass
