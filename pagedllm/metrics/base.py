"""StatLogger: the hooks through which AsyncLLM reports engine and per-request statistics."""
from __future__ import annotations

from pagedllm.core.scheduler import SchedulerStats


class StatLogger:
    """No-op base; a subclass overrides what it records. Called on the event loop: keep them cheap."""

    def record_scheduler_stats(self, stats: SchedulerStats) -> None:
        """Latest engine-core snapshot (gauges, and cumulative counters to turn into increments)."""

    def record_queue_time(self, seconds: float) -> None:
        """Time a request waited in the core before it was first scheduled."""

    def record_prefill_time(self, seconds: float) -> None:
        """Time from a request's first scheduling to its first token, in the core."""

    def record_prompt_tokens(self, num_tokens: int) -> None:
        """Prompt tokens of a request, counted when its first token arrives."""

    def record_first_token(self, seconds: float) -> None:
        """Time to first token, from the request's arrival at the front-end."""

    def record_generation_tokens(self, num_tokens: int) -> None:
        ...

    def record_inter_token(self, seconds: float) -> None:
        """Gap between two consecutive outputs of one sequence."""

    def record_finished(self, finish_reason: str, e2e_seconds: float) -> None:
        """One finished sequence: "stop", "length" or "abort"."""
