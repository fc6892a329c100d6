"""The wire schema between the multiprocess executor and its workers: msgspec structs as msgpack, never pickle.

A step travels as the scheduler's own plain dataclasses; the two things they cannot carry as such ride
beside them: each new request's stop-token set (SamplingParams rebuilds it from its own fields) and the
structured-output bitmask (a tensor, sent as raw int32 bytes).
"""
from __future__ import annotations

import dataclasses
from typing import Union

import msgspec
import numpy as np

from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput

# ---- executor -> worker -------------------------------------------------------------------------


class Execute(msgspec.Struct, tag="exec", array_like=True):
    scheduler_output: SchedulerOutput
    # The tokens the sampling rank drew in the previous step, for ranks that did not sample.
    sampled: dict[str, list[int]]
    all_stop_token_ids: dict[str, list[int]]
    bitmask_shape: list[int] | None = None
    bitmask: bytes | None = None


class DetermineNumBlocks(msgspec.Struct, tag="blocks", array_like=True):
    pass


class InitializeCache(msgspec.Struct, tag="init_cache", array_like=True):
    num_blocks: int


class Reset(msgspec.Struct, tag="reset", array_like=True):
    pass


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


WorkerInput = Union[Execute, DetermineNumBlocks, InitializeCache, Reset, Shutdown]

# ---- worker -> executor -------------------------------------------------------------------------


class Ready(msgspec.Struct, tag="ready", array_like=True):
    rank: int
    pid: int


class Done(msgspec.Struct, tag="done", array_like=True):
    value: int | None = None


class StepDone(msgspec.Struct, tag="step", array_like=True):
    output: ModelRunnerOutput | None  # only from the rank that samples


class Failed(msgspec.Struct, tag="failed", array_like=True):
    rank: int
    summary: str  # the exception and where it was raised, one line
    traceback: str


WorkerOutput = Union[Ready, Done, StepDone, Failed]


def input_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(WorkerInput)


def output_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(WorkerOutput)


def execute_message(so: SchedulerOutput, sampled: dict[str, list[int]]) -> Execute:
    """The step as plain data (see the module docstring)."""
    stops = {nr.req_id: sorted(nr.sampling_params.all_stop_token_ids) for nr in so.scheduled_new_reqs}
    shape = data = None
    if so.grammar_bitmask is not None:
        mask = np.ascontiguousarray(so.grammar_bitmask.cpu().numpy(), dtype=np.int32)
        shape, data = list(mask.shape), mask.tobytes()
        so = dataclasses.replace(so, grammar_bitmask=None)
    return Execute(so, sampled, stops, shape, data)


def scheduler_output_of(msg: Execute) -> SchedulerOutput:
    """The step the executor sent, with what msgpack could not carry put back."""
    import torch

    so = msg.scheduler_output
    for nr in so.scheduled_new_reqs:
        nr.sampling_params.all_stop_token_ids = set(msg.all_stop_token_ids.get(nr.req_id, ()))
    if msg.bitmask is not None:
        mask = np.frombuffer(msg.bitmask, dtype=np.int32).reshape(msg.bitmask_shape).copy()
        so.grammar_bitmask = torch.from_numpy(mask)
    return so
