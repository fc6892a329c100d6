"""Plain data crossing the core/runner seam: SchedulerOutput down, ModelRunnerOutput up, EngineCoreOutput out."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedllm.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has not seen, or one resumed after preemption (its state was dropped)."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # non-empty only when resuming after preemption
    sampling_params: SamplingParams
    seed: int
    block_ids: list[int]
    num_computed_tokens: int


@dataclass
class CachedRequestData:
    """Diffs for requests the runner already holds."""

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)  # appended to the block table
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]  # req_id -> tokens computed this step
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]  # finished since the last step: the runner drops their state
    preempted_req_ids: set[str]  # the runner drops these too; they come back as new requests
    # Structured outputs (filled by the engine core after scheduling): request id -> its row of
    # grammar_bitmask, an int32 tensor [rows, ceil(vocab / 32)] of allowed tokens (bit set: allowed).
    grammar_rows: dict[str, int] = field(default_factory=dict)
    grammar_bitmask: Any = None

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


# Logprobs as plain lists: per position, token ids [K+1] (the chosen token first), logprobs [K+1],
# and the chosen token's rank.
@dataclass
class LogprobsLists:
    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]
    # One list per request in req_ids: [] when the step only computed part of a prompt.
    sampled_token_ids: list[list[int]]
    logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    prompt_logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    # The step's time on the device, when the runner measured it (CUDA with submit_just_in_time).
    device_time_s: float | None = None
    # Requests whose part of the step failed (their sampling raised, or their logits held no valid
    # token), with the reason: the scheduler ends each one alone.
    errors: dict[str, str] = field(default_factory=dict)


@dataclass
class EngineCoreOutput:
    req_id: str
    new_token_ids: list[int]
    new_logprobs: LogprobsLists | None = None
    new_prompt_logprobs: LogprobsLists | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token or string; the message, for "error"
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
