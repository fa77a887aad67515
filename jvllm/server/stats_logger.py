"""The periodic stats line of `jvllm serve` (vLLM's, off with `--disable-log-stats`).

Owns turning two snapshots of the engine's counters into one log line: prompt and
generation throughput over the interval, running and waiting requests, KV-cache
usage, and the prefix-cache hit rate since startup; with speculative decoding a second
line (vLLM's "SpecDecoding metrics") gives the interval's mean acceptance length, the
accepted and drafted tokens and the acceptance rate per draft position. Idle intervals
log nothing, so an idle server's log stays quiet. The counters themselves are the
engine's.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable

logger = logging.getLogger("jvllm.server")

DEFAULT_INTERVAL_S = 10.0  # vLLM's VLLM_LOG_STATS_INTERVAL default
INTERVAL_ENV = "JVLLM_LOG_STATS_INTERVAL"


def stats_interval() -> float:
    value = os.environ.get(INTERVAL_ENV)
    if value is None:
        return DEFAULT_INTERVAL_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = 0.0
    if not seconds > 0:
        raise ValueError(f"{INTERVAL_ENV} must be a number of seconds > 0, got {value!r}")
    return seconds


class StatsLogger:
    def __init__(self, metrics: Callable[[], dict[str, float]], interval: float) -> None:
        self.metrics, self.interval = metrics, interval
        self._last = dict(metrics())
        self._last_time = time.monotonic()

    def line(self) -> str | None:
        """The line for the interval since the last call; None if nothing happened."""
        now, m = time.monotonic(), dict(self.metrics())
        seconds = max(now - self._last_time, 1e-9)
        prompt = m["prompt_tokens"] - self._last["prompt_tokens"]
        generated = m["generation_tokens"] - self._last["generation_tokens"]
        last, self._last, self._last_time = self._last, m, now
        busy = m["num_requests_running"] or m["num_requests_waiting"]
        if not (prompt or generated or busy):
            return None
        hit_rate = m["prefix_cache_hits"] / max(m["prefix_cache_queries"], 1)
        spec = _spec_line(m, last)
        return (
            f"Avg prompt throughput: {prompt / seconds:.1f} tokens/s, "
            f"Avg generation throughput: {generated / seconds:.1f} tokens/s, "
            f"Running: {m['num_requests_running']:.0f} reqs, "
            f"Waiting: {m['num_requests_waiting']:.0f} reqs, "
            f"KV cache usage: {100 * m['kv_cache_usage_perc']:.1f}%, "
            f"Prefix cache hit rate: {100 * hit_rate:.1f}%"
        ) + (f"\n{spec}" if spec else "")

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            line = self.line()
            if line is not None:
                logger.info("%s", line)


def _spec_line(m: dict, last: dict) -> str:
    """The interval's speculative decoding as a line of its own ('' without drafts)."""
    drafts = m.get("spec_decode_num_drafts", 0) - last.get("spec_decode_num_drafts", 0)
    if not drafts:
        return ""
    key = "spec_decode_num_accepted_tokens"
    accepted = m[key] - last[key]
    drafted = m["spec_decode_num_draft_tokens"] - last["spec_decode_num_draft_tokens"]
    now = m[key + "_per_pos"]
    before = last.get(key + "_per_pos") or [0] * len(now)
    rates = ", ".join(f"{(a - b) / drafts:.3f}" for a, b in zip(now, before, strict=True))
    return (
        f"SpecDecoding metrics: Mean acceptance length: {1 + accepted / drafts:.2f}, "
        f"Accepted: {accepted} tokens, Drafted: {drafted} tokens, "
        f"Per-position acceptance rate: {rates}, "
        f"Avg Draft acceptance rate: {100 * accepted / max(drafted, 1):.1f}%"
    )
