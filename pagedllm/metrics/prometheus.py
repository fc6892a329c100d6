"""Prometheus metrics with vLLM's names under a `pagedllm:` prefix, on a registry owned by one app.

Nothing lives at module level: every server builds its own CollectorRegistry, so two apps in one
process (tests) never share or double-register metrics. Gauges follow the engine core's latest
SchedulerStats; the core's cumulative counters are turned into increments here.
"""
from __future__ import annotations

from pagedllm.core.scheduler import SchedulerStats
from pagedllm.metrics.base import StatLogger

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0)
FINISH_REASONS = ("stop", "length", "abort")


class _EngineSeries:
    """The children of every metric family for one engine core (label engine="i")."""

    def __init__(self, families: dict, model_name: str, engine: int) -> None:
        lv = {"model_name": model_name, "engine": str(engine)}
        for attr, family in families.items():
            if attr == "success":
                # Every label set exists from the start, so a dashboard sees zeros rather than no series.
                self.success = {r: family.labels(finished_reason=r, **lv) for r in FINISH_REASONS}
            else:
                setattr(self, attr, family.labels(**lv))
        self.last = SchedulerStats()


class PrometheusStatLogger(StatLogger):
    """Every series carries `model_name` and `engine` (the data-parallel core index, "0" without
    data parallelism), so per-core load is visible and sum() over `engine` gives the server's."""

    def __init__(self, model_name: str, registry=None, num_engines: int = 1) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = registry if registry is not None else CollectorRegistry()
        labels = ["model_name", "engine"]

        def gauge(name: str, doc: str):
            return Gauge(f"pagedllm:{name}", doc, labels, registry=self.registry)

        def counter(name: str, doc: str):
            return Counter(f"pagedllm:{name}", doc, labels, registry=self.registry)

        def histogram(name: str, doc: str, buckets):
            return Histogram(f"pagedllm:{name}", doc, labels, buckets=buckets, registry=self.registry)

        self._families = {
            "num_running": gauge("num_requests_running", "Requests in the running batch."),
            "num_waiting": gauge("num_requests_waiting", "Requests waiting to be scheduled (incl. preempted)."),
            "kv_usage": gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full)."),
            "prefix_queries": counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
            "prefix_hits": counter("prefix_cache_hits", "Prompt tokens found in the prefix cache."),
            "preemptions": counter("num_preemptions", "Preemptions (a running request evicted to free blocks)."),
            "prompt_tokens": counter("prompt_tokens", "Prompt tokens processed."),
            "generation_tokens": counter("generation_tokens", "Tokens generated."),
            "success": Counter(
                "pagedllm:request_success", "Finished sequences by finish reason.", labels + ["finished_reason"],
                registry=self.registry,
            ),
            "ttft": histogram("time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS),
            "itl": histogram("inter_token_latency_seconds", "Time between consecutive outputs of a sequence.", _ITL_BUCKETS),
            "e2e": histogram("e2e_request_latency_seconds", "Arrival to finish, per sequence.", _REQUEST_BUCKETS),
            "queue_time": histogram(
                "request_queue_time_seconds", "Time waiting in the core before first scheduled.", _REQUEST_BUCKETS
            ),
            "prefill_time": histogram(
                "request_prefill_time_seconds", "First scheduled to first token, in the core.", _TTFT_BUCKETS
            ),
        }
        self._model_name = model_name
        self._engines: dict[int, _EngineSeries] = {}
        for i in range(num_engines):
            self._of(i)

    def _of(self, engine: int) -> _EngineSeries:
        series = self._engines.get(engine)
        if series is None:
            series = self._engines[engine] = _EngineSeries(self._families, self._model_name, engine)
        return series

    def record_scheduler_stats(self, stats: SchedulerStats, engine: int = 0) -> None:
        e = self._of(engine)
        e.num_running.set(stats.num_running_reqs)
        e.num_waiting.set(stats.num_waiting_reqs)
        e.kv_usage.set(stats.kv_cache_usage)
        last = e.last
        for counter, now, before in (
            (e.prefix_queries, stats.prefix_cache_queries, last.prefix_cache_queries),
            (e.prefix_hits, stats.prefix_cache_hits, last.prefix_cache_hits),
            (e.preemptions, stats.num_preemptions, last.num_preemptions),
        ):
            if now > before:
                counter.inc(now - before)
        e.last = stats

    def record_queue_time(self, seconds: float, engine: int = 0) -> None:
        self._of(engine).queue_time.observe(seconds)

    def record_prefill_time(self, seconds: float, engine: int = 0) -> None:
        self._of(engine).prefill_time.observe(seconds)

    def record_prompt_tokens(self, num_tokens: int, engine: int = 0) -> None:
        self._of(engine).prompt_tokens.inc(num_tokens)

    def record_first_token(self, seconds: float, engine: int = 0) -> None:
        self._of(engine).ttft.observe(seconds)

    def record_generation_tokens(self, num_tokens: int, engine: int = 0) -> None:
        self._of(engine).generation_tokens.inc(num_tokens)

    def record_inter_token(self, seconds: float, engine: int = 0) -> None:
        self._of(engine).itl.observe(seconds)

    def record_finished(self, finish_reason: str, e2e_seconds: float, engine: int = 0) -> None:
        e = self._of(engine)
        child = e.success.get(finish_reason)
        if child is None:
            child = self._families["success"].labels(
                model_name=self._model_name, engine=str(engine), finished_reason=finish_reason
            )
            e.success[finish_reason] = child
        child.inc()
        e.e2e.observe(e2e_seconds)

    def exposition(self) -> tuple[bytes, str]:
        """The /metrics body and its content type."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
