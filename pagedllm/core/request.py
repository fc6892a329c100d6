"""Request: one sequence's token ids, progress (num_computed_tokens) and status inside the engine core."""
from __future__ import annotations

import enum
import time

from pagedllm.core.hashing import BlockHasher
from pagedllm.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything from here on is finished.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    # Its processing raised (or its logits held no valid token): ended alone, with a message.
    FINISHED_ERROR = 6

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """A request as the scheduler sees it: no prefill or decode phase, only computed vs known tokens."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        seed: int,
        eos_token_ids: frozenset[int] = frozenset(),
        arrival_time: float | None = None,
        cache_salt: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.sampling_params = sampling_params
        self.seed = seed  # keys this request's random stream (see pagedllm.sample)
        self.eos_token_ids = eos_token_ids
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        # Scheduled steps that will sample a token for this request and whose output has not been
        # applied yet: 0 between steps when scheduling is synchronous, up to 1 more when it runs ahead.
        self.num_pending_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit length at first schedule; -1 until then
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.first_scheduled_time: float | None = None
        self.max_tokens = sampling_params.max_tokens
        self.block_hasher = BlockHasher(extra_keys=(cache_salt,) if cache_salt else None)
        # Structured outputs: the grammar's state after this request's output tokens (an xgrammar
        # GrammarMatcher, set by the engine core once the grammar is compiled; opaque here).
        self.grammar_matcher: object | None = None
        # With a reasoning parser: where the answer (the grammar's part of the output) begins.
        self.reasoning_gate: object | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def block_hashes(self, block_size: int) -> list[bytes]:
        """Hashes of every full block of known tokens, computed incrementally."""
        return self.block_hasher.update(self.all_token_ids, block_size)

    @property
    def skips_prefix_cache(self) -> bool:
        # Prompt logprobs need the logits of every prompt position, so nothing may be skipped.
        return self.sampling_params.prompt_logprobs is not None
