"""Plain records of a model-runner step: what it computed, its forward pass, and what it leaves in flight."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from pagedllm.core.scheduler_output import LogprobsLists, SchedulerOutput
from pagedllm.worker.gpu_buffers import DeviceInputs
from pagedllm.worker.input_batch import BatchInputs


def logprobs_to_lists(lp, ks: list[int] | None = None) -> list[LogprobsLists]:
    """Splits LogprobsTensors rows into per-row LogprobsLists, keeping 1 + k columns for row i."""
    ids, vals, ranks = lp.token_ids.tolist(), lp.logprobs.tolist(), lp.ranks.tolist()
    out = []
    for i in range(len(ids)):
        k = 1 + (ks[i] if ks is not None else len(ids[i]) - 1)
        out.append(LogprobsLists([ids[i][:k]], [vals[i][:k]], [ranks[i]]))
    return out


@dataclass
class StepInfo:
    """What the last step computed, for benchmarks and logs."""

    num_reqs: int
    num_tokens: int
    context_tokens: int  # sum of sequence lengths: the cached K/V entries attention read
    graph_size: int  # padded batch size of the replayed decode graph; 0 when none was replayed
    graph_tokens: int = 0  # padded token count of the replayed mixed-batch graph; 0 when none was


class ForwardPass(NamedTuple):
    hidden: torch.Tensor  # [>= T, H], or [>= B, H] when per_request
    dev: DeviceInputs
    graph_size: int  # see StepInfo
    graph_tokens: int
    per_request: bool = False  # hidden holds each request's last token only (row i: request i)


class DeferredSampling(NamedTuple):
    """A submitted step whose sampling is not launched yet (``ModelRunner.submit`` → ``launch_sampling``)."""

    batch: BatchInputs  # the step's host inputs
    fwd: ForwardPass  # its forward pass: hidden [>= T or >= B, H], device views
    start_event: torch.cuda.Event | None  # recorded before the forward pass when steps are timed
    scheduler_output: SchedulerOutput  # its grammar bitmask may still be filling until the sampling launch


def last_token_rows(query_start_loc: torch.Tensor) -> torch.Tensor:  # [B + 1] int32 -> [B] int64
    """The flat row of each request's last scheduled token (every request schedules at least one)."""
    return query_start_loc[1:].to(torch.int64) - 1


class LogprobsTensorsOnHost(NamedTuple):
    token_ids: torch.Tensor  # [S, K + 1]
    logprobs: torch.Tensor  # [S, K + 1]
    ranks: torch.Tensor  # [S]


@dataclass
class StepInFlight:
    """A launched step: what its output needs once the device is done with it."""

    req_ids: list[str]
    prompt_logprobs: dict[str, LogprobsLists]
    rows: list[int] = field(default_factory=list)  # indices into req_ids of the sampled requests
    states: list = field(default_factory=list)  # their CachedRequestStates, in the same order
    token_ids: torch.Tensor | None = None  # [S] on the device: the next step's pending tokens read it
    sampled_row: dict[str, int] = field(default_factory=dict)  # req_id -> row of token_ids
    host_token_ids: torch.Tensor | None = None  # [S] on the host, valid once ``event`` has passed
    host_logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    want: list[int | None] = field(default_factory=list)  # logprobs asked for, per sampled request
    event: torch.cuda.Event | None = None
    start_event: torch.cuda.Event | None = None  # recorded before the step's first kernel (timed steps)
    errors: dict[str, str] = field(default_factory=dict)  # req_id -> why its sampling failed
