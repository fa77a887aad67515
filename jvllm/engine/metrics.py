"""The engine's statistics: one dataclass field per metric, read by every consumer.

Owns what each metric means (its help text and unit) and whether /metrics exports it
as a Prometheus gauge or counter (`metric(kind, help)` on the field). `get_metrics()`
is `EngineStats.as_dict()`, and `jvllm.server.metrics` builds its table from
`exported_metrics()`: adding a metric is one field here and the line that fills it.
Does not own the latency histograms (AsyncLLM observes those) nor the counting itself
(the scheduler, the output processor and the speculator keep their counters).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

Kind = Literal["gauge", "counter"] | None
GAUGE: Kind = "gauge"
COUNTER: Kind = "counter"  # cumulative; Prometheus adds `_total`


def metric(kind: Kind, help: str) -> Any:
    """A stats field: its Prometheus kind (None: in get_metrics() only) and help text."""
    return field(metadata={"kind": kind, "help": help})


@dataclass(frozen=True)
class SchedulerStats:
    num_requests_running: int = metric(GAUGE, "Requests running on the device")
    num_requests_waiting: int = metric(GAUGE, "Requests waiting to be scheduled")
    num_free_blocks: int = metric(GAUGE, "KV-cache blocks free for allocation")
    num_total_blocks: int = metric(None, "Usable KV-cache blocks (num_blocks - 1)")
    kv_cache_usage_perc: float = metric(GAUGE, "Fraction of KV blocks in use (0-1)")
    prefix_cache_queries: int = metric(COUNTER, "Prompt tokens looked up")
    prefix_cache_hits: int = metric(COUNTER, "Prompt tokens found in the cache")
    num_preemptions: int = metric(COUNTER, "Requests preempted to free KV blocks")
    num_live_tokens: int = metric(None, "Running requests' computed tokens, queued steps too")
    num_allocated_slots: int = metric(None, "Held KV blocks times block_size")
    num_requests_swapped: int = metric(GAUGE, "Requests swapped out to host")
    num_swapped_out_blocks: int = metric(COUNTER, "KV blocks copied to host")
    num_swapped_in_blocks: int = metric(COUNTER, "KV blocks copied back from host")
    num_recomputed_tokens: int = metric(COUNTER, "Computed tokens dropped by recompute preemption")
    num_host_blocks: int = metric(None, "Host swap blocks in all (0 without swap)")
    num_free_host_blocks: int = metric(GAUGE, "Host swap blocks free")
    prefix_cache_host_hits: int = metric(None, "Of prefix_cache_hits, tokens from the host tier")
    num_offloaded_blocks: int = metric(None, "Evicted cached blocks copied to the host tier")
    num_onloaded_blocks: int = metric(None, "Host-tier hits copied back")
    num_tier_blocks: int = metric(None, "The host tier's size in blocks")
    num_used_tier_blocks: int = metric(None, "Host-tier blocks in use")


@dataclass(frozen=True)
class SpecDecodeStats:
    """vLLM's names; all zero without speculative decoding."""

    spec_decode_num_drafts: int = metric(COUNTER, "Rows that verified drafts")
    spec_decode_num_draft_tokens: int = metric(COUNTER, "Draft tokens verified")
    spec_decode_num_accepted_tokens: int = metric(COUNTER, "Draft tokens accepted")
    # Exported by /metrics as one counter labelled by position.
    spec_decode_num_accepted_tokens_per_pos: list[int] = metric(
        None, "Draft tokens accepted, by draft position (position 0 first)"
    )


@dataclass(frozen=True)
class EngineStats:
    scheduler: SchedulerStats
    spec_decode: SpecDecodeStats
    prompt_tokens: int = metric(COUNTER, "Prompt tokens received")
    generation_tokens: int = metric(COUNTER, "Tokens generated")
    num_compilations: int = metric(None, "Compiled device programs held")
    # A field with a default: set by finish_weight_update(weight_version=...).
    weight_version: Any = metric(None, "The weights' version (None: as loaded)")

    def as_dict(self) -> dict[str, Any]:
        """Every metric by name, flat (`LLMEngine.get_metrics()`)."""
        out: dict[str, Any] = {}
        for part in (self.scheduler, self.spec_decode, self):
            for f in _metric_fields(type(part)):
                value = getattr(part, f.name)
                out[f.name] = list(value) if isinstance(value, list) else value
        return out


def _metric_fields(cls: type) -> list[dataclasses.Field[Any]]:
    return [f for f in dataclasses.fields(cls) if "kind" in f.metadata]


def exported_metrics() -> list[tuple[str, Kind, str]]:
    """(name, kind, help) of every metric /metrics exports as a gauge or counter."""
    return [
        (f.name, f.metadata["kind"], f.metadata["help"])
        for cls in (SchedulerStats, SpecDecodeStats, EngineStats)
        for f in _metric_fields(cls)
        if f.metadata["kind"] is not None
    ]
