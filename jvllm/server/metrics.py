"""Prometheus metrics for GET /metrics, in a registry of their own.

Owns the metric names (`jvllm:*`); which are gauges or counters, and their help, is
`jvllm.engine.metrics`' (the fields of the engine's stats).
Gauges and counters are read at scrape time from the engine's metrics snapshot
(counters are exposed with Prometheus' `_total` suffix); the four latency
histograms are fed by AsyncLLM on the engine thread (prometheus_client is
thread-safe).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from jvllm.engine.async_llm import E2E, ITL, QUEUE_TIME, TTFT
from jvllm.engine.metrics import COUNTER, GAUGE, exported_metrics

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# metric name -> (get_metrics() key, help), from the engine's stats dataclasses
_GAUGES = {f"jvllm:{k}": (k, doc) for k, kind, doc in exported_metrics() if kind == GAUGE}
_COUNTERS = {f"jvllm:{k}": (k, doc) for k, kind, doc in exported_metrics() if kind == COUNTER}
_PER_POSITION = "jvllm:spec_decode_num_accepted_tokens_per_pos"
_HISTOGRAMS = {
    QUEUE_TIME: ("jvllm:request_queue_time_seconds", "Arrival to first scheduled step"),
    TTFT: ("jvllm:time_to_first_token_seconds", "Arrival to first generated token"),
    ITL: ("jvllm:inter_token_latency_seconds", "Time between generated tokens"),
    E2E: ("jvllm:e2e_request_latency_seconds", "Arrival to finish"),
}
_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0,
)  # fmt: skip


class _EngineCollector(Collector):
    def __init__(self, snapshot: Callable[[], dict[str, float]]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        values = self._snapshot()
        for name, (key, doc) in _GAUGES.items():
            yield GaugeMetricFamily(name, doc, value=float(values.get(key, 0)))
        for name, (key, doc) in _COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=float(values.get(key, 0)))
        per_pos = values.get("spec_decode_num_accepted_tokens_per_pos") or []
        if per_pos:
            family = CounterMetricFamily(
                _PER_POSITION, "Draft tokens accepted, by draft position", labels=["position"]
            )
            for position, count in enumerate(per_pos):
                family.add_metric([str(position)], float(count))
            yield family


class ServerMetrics:
    """The registry behind /metrics; `observe` is AsyncLLM's LatencyObserver."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._histograms = {
            key: Histogram(name, doc, buckets=_BUCKETS, registry=self.registry)
            for key, (name, doc) in _HISTOGRAMS.items()
        }
        self._collector: _EngineCollector | None = None

    def attach(self, snapshot: Callable[[], dict[str, float]]) -> None:
        """Reads gauges and counters from `snapshot` (the engine's get_metrics) from now on."""
        assert self._collector is None, "attach once"
        self._collector = _EngineCollector(snapshot)
        self.registry.register(self._collector)

    def observe(self, name: str, seconds: float) -> None:
        self._histograms[name].observe(max(seconds, 0.0))

    def render(self) -> bytes:
        return generate_latest(self.registry)
