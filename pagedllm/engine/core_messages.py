"""The wire schema between the front-end (AsyncLLM) and the engine-core process: msgspec structs, msgpack.

Everything that crosses the socket is plain data (ints, floats, strings, lists, maps) described here,
so neither side ever unpickles bytes from a socket. Each struct is tagged, and a side decodes the
union of what it may receive; a message of any other shape is a decode error, not code execution.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Union

import msgspec

from pagedllm.core.scheduler import SchedulerStats
from pagedllm.core.scheduler_output import EngineCoreOutput
from pagedllm.sampling_params import SamplingParams

# ---- front-end -> core -------------------------------------------------------------------------


class AddRequest(msgspec.Struct, tag="add", array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    params: dict[str, Any]  # SamplingParams as a plain dict (see params_to_dict)
    seed: int
    eos_token_ids: list[int]


class Abort(msgspec.Struct, tag="abort", array_like=True):
    request_ids: list[str]


class FinishByStopString(msgspec.Struct, tag="stop", array_like=True):
    request_id: str
    stop: str


class UtilityCall(msgspec.Struct, tag="call", array_like=True):
    call_id: int
    method: str  # one of core_proc.UTILITY_METHODS
    args: list[Any] = []


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


class Wake(msgspec.Struct, tag="wake", array_like=True):
    """Data-parallel cores in lockstep: another core got a request, so this one must leave its wait for input
    and join the next agreement (core_proc._LockstepLoop)."""


CoreInput = Union[AddRequest, Abort, FinishByStopString, UtilityCall, Shutdown, Wake]

# ---- core -> front-end -------------------------------------------------------------------------


class Ready(msgspec.Struct, tag="ready", array_like=True):
    num_blocks: int
    pid: int


class CoreOutputs(msgspec.Struct, tag="out", array_like=True):
    outputs: list[EngineCoreOutput]
    stats: SchedulerStats
    # Requests first scheduled since the last message: request id -> seconds spent waiting in the core.
    queue_times: dict[str, float] = {}
    # Requests whose first token arrived since the last message: request id -> seconds from first scheduled.
    prefill_times: dict[str, float] = {}


class UtilityResult(msgspec.Struct, tag="result", array_like=True):
    call_id: int
    result: Any = None
    error: str | None = None


class EngineDead(msgspec.Struct, tag="dead", array_like=True):
    message: str


CoreOutput = Union[Ready, CoreOutputs, UtilityResult, EngineDead]


def params_to_dict(params: SamplingParams) -> dict[str, Any]:
    """SamplingParams as msgpack-able plain data (sets become sorted lists)."""
    d = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}
    d["all_stop_token_ids"] = sorted(d["all_stop_token_ids"])
    return d


def params_from_dict(d: dict[str, Any]) -> SamplingParams:
    """Rebuilds SamplingParams; all_stop_token_ids is filled by the front-end's Processor, so it is
    restored after __post_init__ (which would reset it to the user's stop_token_ids)."""
    d = dict(d)
    all_stop = d.pop("all_stop_token_ids", None)
    params = SamplingParams(**d)
    if all_stop is not None:
        params.all_stop_token_ids = set(all_stop)
    return params


def input_encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def input_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(CoreInput)


def output_encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def output_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(CoreOutput)
