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


class PrometheusStatLogger(StatLogger):
    def __init__(self, model_name: str, registry=None) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = registry if registry is not None else CollectorRegistry()
        labels = ["model_name"]
        lv = {"model_name": model_name}

        def gauge(name: str, doc: str):
            return Gauge(f"pagedllm:{name}", doc, labels, registry=self.registry).labels(**lv)

        def counter(name: str, doc: str):
            return Counter(f"pagedllm:{name}", doc, labels, registry=self.registry).labels(**lv)

        def histogram(name: str, doc: str, buckets):
            return Histogram(f"pagedllm:{name}", doc, labels, buckets=buckets, registry=self.registry).labels(**lv)

        self.num_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled (incl. preempted).")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.preemptions = counter("num_preemptions", "Preemptions (a running request evicted to free blocks).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        success = Counter(
            "pagedllm:request_success", "Finished sequences by finish reason.", labels + ["finished_reason"],
            registry=self.registry,
        )
        # Every label set exists from the start, so a dashboard sees zeros rather than no series.
        self.success = {r: success.labels(model_name=model_name, finished_reason=r) for r in FINISH_REASONS}
        self._success_family = success
        self._model_name = model_name
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive outputs of a sequence.", _ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish, per sequence.", _REQUEST_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Time waiting in the core before first scheduled.", _REQUEST_BUCKETS)
        self.prefill_time = histogram(
            "request_prefill_time_seconds", "First scheduled to first token, in the core.", _TTFT_BUCKETS
        )
        self._last = SchedulerStats()

    def record_scheduler_stats(self, stats: SchedulerStats) -> None:
        self.num_running.set(stats.num_running_reqs)
        self.num_waiting.set(stats.num_waiting_reqs)
        self.kv_usage.set(stats.kv_cache_usage)
        last = self._last
        for counter, now, before in (
            (self.prefix_queries, stats.prefix_cache_queries, last.prefix_cache_queries),
            (self.prefix_hits, stats.prefix_cache_hits, last.prefix_cache_hits),
            (self.preemptions, stats.num_preemptions, last.num_preemptions),
        ):
            if now > before:
                counter.inc(now - before)
        self._last = stats

    def record_queue_time(self, seconds: float) -> None:
        self.queue_time.observe(seconds)

    def record_prefill_time(self, seconds: float) -> None:
        self.prefill_time.observe(seconds)

    def record_prompt_tokens(self, num_tokens: int) -> None:
        self.prompt_tokens.inc(num_tokens)

    def record_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def record_generation_tokens(self, num_tokens: int) -> None:
        self.generation_tokens.inc(num_tokens)

    def record_inter_token(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def record_finished(self, finish_reason: str, e2e_seconds: float) -> None:
        child = self.success.get(finish_reason)
        if child is None:
            child = self._success_family.labels(model_name=self._model_name, finished_reason=finish_reason)
            self.success[finish_reason] = child
        child.inc()
        self.e2e.observe(e2e_seconds)

    def exposition(self) -> tuple[bytes, str]:
        """The /metrics body and its content type."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
