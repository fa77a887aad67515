"""Prometheus metrics for GET /metrics, in a registry of their own, under vLLM's names.

Owns the exported names, labels and buckets. A metric vLLM also has keeps vLLM's name
and type (`vllm:num_requests_waiting`, `vllm:time_to_first_token_seconds`, ...), so that
dashboards and autoscalers written for vLLM read jvllm unchanged; what only jvllm has
(swap and the host tier's figures, free blocks) is `jvllm:*`. Every sample carries vLLM's
labels `model_name` (the first served name) and `engine` (the engine's index, "0").
Which engine stats are gauges or counters, and their help, is `jvllm.engine.metrics`';
gauges and counters are read at scrape time from the engine's metrics snapshot
(counters get Prometheus' `_total` suffix). The histograms and the finish-reason counter
are fed by AsyncLLM on the engine thread through `observe` and `finished`
(prometheus_client is thread-safe).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from jvllm.engine.metrics import COUNTER, GAUGE, exported_metrics
from jvllm.engine.request_timing import E2E, ITL, QUEUE_TIME, TTFT, FinishedRequestStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LABELS = ["model_name", "engine"]
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")  # vLLM's FinishReason

# Engine stats vLLM exports too: their vLLM names. The rest are exported as jvllm:<key>.
VLLM_NAMES = {
    key: f"vllm:{key}"
    for key in (
        "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
        "prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "prompt_tokens",
        "generation_tokens", "spec_decode_num_drafts", "spec_decode_num_draft_tokens",
        "spec_decode_num_accepted_tokens",
    )
}  # fmt: skip
_PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"
_LATENCY = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_REQUEST = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
_PER_TOKEN = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
# AsyncLLM's latency names -> (histogram, help, buckets).
_LATENCIES = {
    QUEUE_TIME: (
        "vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
    ),
    TTFT: ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds."),
    ITL: ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds."),
    E2E: ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds."),
}  # fmt: skip
_BUCKETS = {QUEUE_TIME: _REQUEST, TTFT: _LATENCY, ITL: _PER_TOKEN, E2E: _REQUEST}


def exported_name(key: str) -> str:
    """The /metrics name of an engine stat (`get_metrics()` key)."""
    return VLLM_NAMES.get(key, f"jvllm:{key}")


def count_buckets(max_value: int) -> list[float]:
    """vLLM's 1-2-5 buckets up to `max_value` (token counts per request)."""
    buckets, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return buckets
            buckets.append(float(m * scale))
        scale *= 10


class _EngineCollector(Collector):
    def __init__(self, snapshot: Callable[[], dict[str, Any]], labels: list[str]) -> None:
        self._snapshot = snapshot
        self._labels = labels
        self._table = [(k, kind, exported_name(k), doc) for k, kind, doc in exported_metrics()]

    def collect(self) -> Iterator[Metric]:
        values = self._snapshot()
        # Data-parallel engine cores: one sample per engine, labelled with its DP rank.
        engines = values.get("engines") or [values]
        labels = [[self._labels[0], str(i)] for i in range(len(engines))]
        if len(engines) == 1:
            labels = [self._labels]
        for key, kind, name, doc in self._table:
            cls = GaugeMetricFamily if kind == GAUGE else CounterMetricFamily
            assert kind in (GAUGE, COUNTER), kind
            family = cls(name, doc, labels=LABELS)
            for engine_labels, engine_values in zip(labels, engines, strict=True):
                family.add_metric(engine_labels, float(engine_values.get(key, 0)))
            yield family
        per_pos = values.get("spec_decode_num_accepted_tokens_per_pos") or []
        if per_pos:
            family = CounterMetricFamily(
                _PER_POSITION, "Accepted tokens per draft position.", labels=[*LABELS, "position"]
            )
            for position, count in enumerate(per_pos):
                family.add_metric([*self._labels, str(position)], float(count))
            yield family


class ServerMetrics:
    """The registry behind /metrics; AsyncLLM's LatencyObserver (`observe`, `finished`)."""

    def __init__(
        self,
        model_name: str = "",
        max_model_len: int = 2048,
        engine_index: int = 0,
        cache_config_info: dict[str, Any] | None = None,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.labels = [model_name, str(engine_index)]
        self._histograms = {
            key: self._histogram(name, doc, _BUCKETS[key])
            for key, (name, doc) in _LATENCIES.items()
        }
        self._phases = {
            phase: self._histogram(f"vllm:request_{phase}_time_seconds", doc, _REQUEST)
            for phase, doc in (
                ("inference", "Histogram of time spent in RUNNING phase for request."),
                ("prefill", "Histogram of time spent in PREFILL phase for request."),
                ("decode", "Histogram of time spent in DECODE phase for request."),
            )
        }
        self._tpot = self._histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            _PER_TOKEN,
        )
        tokens = count_buckets(max_model_len)
        self._prompt_tokens = self._histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", tokens
        )
        self._generation_tokens = self._histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", tokens
        )
        self._max_tokens = self._histogram(
            "vllm:request_params_max_tokens",
            "Histogram of the max_tokens request parameter.",
            tokens,
        )
        self._n = self._histogram(
            "vllm:request_params_n", "Histogram of the n request parameter.", [1, 2, 5, 10, 20]
        )
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*LABELS, "finished_reason"],
            registry=self.registry,
        )
        self._success = {r: success.labels(*self.labels, r) for r in FINISH_REASONS}
        if cache_config_info is not None:
            self._info_gauge(
                "vllm:cache_config_info",
                "Information of the LLMEngine CacheConfig",
                cache_config_info,
            )
        self._collector: _EngineCollector | None = None

    def _histogram(self, name: str, doc: str, buckets: Any) -> Any:
        hist = Histogram(name, doc, LABELS, buckets=buckets, registry=self.registry)
        return hist.labels(*self.labels)

    def _info_gauge(self, name: str, doc: str, info: dict[str, Any]) -> None:
        """vLLM's info metrics: a gauge set to 1 whose labels carry the configuration."""
        info = {k: str(v) for k, v in info.items()} | {"engine": self.labels[1]}
        Gauge(name, doc, list(info), registry=self.registry).labels(**info).set(1)

    def attach(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        """Reads gauges and counters from `snapshot` (the engine's get_metrics) from now on."""
        assert self._collector is None, "attach once"
        self._collector = _EngineCollector(snapshot, self.labels)
        self.registry.register(self._collector)

    def observe(self, name: str, seconds: float) -> None:
        self._histograms[name].observe(max(seconds, 0.0))

    def finished(self, stats: FinishedRequestStats) -> None:
        reason = stats.finish_reason if stats.finish_reason in self._success else "abort"
        self._success[reason].inc()
        if reason == "abort":
            return  # cut short: its times and sizes would skew the histograms
        self._phases["inference"].observe(max(stats.inference_time, 0.0))
        self._phases["prefill"].observe(max(stats.prefill_time, 0.0))
        self._phases["decode"].observe(max(stats.decode_time, 0.0))
        if stats.num_generation_tokens > 1:
            self._tpot.observe(stats.mean_time_per_output_token)
        self._prompt_tokens.observe(stats.num_prompt_tokens)
        self._generation_tokens.observe(stats.num_generation_tokens)
        self._n.observe(stats.n)
        if stats.max_tokens is not None:
            self._max_tokens.observe(stats.max_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
