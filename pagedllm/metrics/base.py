"""StatLogger: the hooks through which AsyncLLM reports engine and per-request statistics."""
from __future__ import annotations

from pagedllm.core.scheduler import SchedulerStats


class StatLogger:
    """No-op base; a subclass overrides what it records. Called on the event loop: keep them cheap.
    `engine` is the data-parallel core the figure comes from (0 without data parallelism)."""

    def record_scheduler_stats(self, stats: SchedulerStats, engine: int = 0) -> None:
        """Latest engine-core snapshot (gauges, and cumulative counters to turn into increments)."""

    def record_queue_time(self, seconds: float, engine: int = 0) -> None:
        """Time a request waited in the core before it was first scheduled."""

    def record_prefill_time(self, seconds: float, engine: int = 0) -> None:
        """Time from a request's first scheduling to its first token, in the core."""

    def record_prompt_tokens(self, num_tokens: int, engine: int = 0) -> None:
        """Prompt tokens of a request, counted when its first token arrives."""

    def record_first_token(self, seconds: float, engine: int = 0) -> None:
        """Time to first token, from the request's arrival at the front-end."""

    def record_generation_tokens(self, num_tokens: int, engine: int = 0) -> None:
        ...

    def record_inter_token(self, seconds: float, engine: int = 0) -> None:
        """Gap between two consecutive outputs of one sequence."""

    def record_finished(self, finish_reason: str, e2e_seconds: float, engine: int = 0) -> None:
        """One finished sequence: "stop", "length" or "abort"."""
