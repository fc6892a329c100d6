"""Offline data parallelism: LLM(data_parallel_size=2) runs two engine-core processes, gives the same
greedy tokens as one core, spreads requests over both, and fails fast (naming the core) when one dies,
leaving no process behind."""
from __future__ import annotations

import os
import signal
import time

import psutil
import pytest
from tiny_models import make_tiny_model_with_tokenizer

from pagedllm import LLM, SamplingParams
from pagedllm.engine.core_client import EngineDeadError

PROMPTS = ["Once upon a time", "The capital of France is", "def fibonacci(n):", "In the beginning",
           "A B C D E F G", "Hello there, how"]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_tiny_model_with_tokenizer("mistral", tmp_path_factory.mktemp("dp-model"))


def _llm(path: str, dp: int) -> LLM:
    return LLM(model=path, dtype="float32", device="cpu", max_model_len=128, kv_cache_memory_bytes=1 << 22,
               data_parallel_size=dp)


def _children_alive(pids: list[int]) -> list[int]:
    return [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def test_dp2_same_greedy_tokens_as_dp1_and_both_cores_used(model_path):
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    one = _llm(model_path, 1)
    try:
        want = [list(o.outputs[0].token_ids) for o in one.generate(PROMPTS, params, use_tqdm=False)]
    finally:
        one.llm_engine.shutdown()
    two = _llm(model_path, 2)
    client = two.llm_engine.dp_client
    pids = client.pids
    try:
        assert len(set(pids)) == 2 and len(_children_alive(pids)) == 2
        got = [list(o.outputs[0].token_ids) for o in two.generate(PROMPTS, params, use_tqdm=False)]
        assert got == want
        assert all(n > 0 for n in client.router.num_routed), client.router.num_routed
        assert sum(client.router.num_routed) == len(PROMPTS)
        assert client.router.load(0) == 0 and client.router.load(1) == 0  # every request accounted as done
    finally:
        two.llm_engine.shutdown()
    assert _children_alive(pids) == []


def test_each_core_gets_its_own_devices():
    from pagedllm.engine.dp_client import core_devices
    from pagedllm.engine_args import EngineArgs

    args = EngineArgs(model="unused", tensor_parallel_size=2, data_parallel_size=2)
    assert core_devices(args, 0, None) == "0,1" and core_devices(args, 1, None) == "2,3"
    assert core_devices(args, 1, "4, 5,6,7") == "6,7"  # positions in the front-end's visible list
    with pytest.raises(ValueError, match="needs 4 devices; CUDA_VISIBLE_DEVICES lists 3"):
        core_devices(args, 1, "0,1,2")


def test_dp_size_is_validated():
    with pytest.raises(ValueError, match="data_parallel_size must be an integer >= 1, got 0"):
        LLM(model="unused", data_parallel_size=0)
    with pytest.raises(ValueError, match="data_parallel_size must be <= 64 .* got 65"):
        LLM(model="unused", data_parallel_size=65)


def test_killed_core_fails_requests_fast_and_leaves_no_process(model_path):
    llm = _llm(model_path, 2)
    client = llm.llm_engine.dp_client
    pids = client.pids
    try:
        os.kill(pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match="data-parallel engine core 1"):
            llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True), use_tqdm=False)
        assert time.monotonic() - t0 < 10
        with pytest.raises(EngineDeadError):
            llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2), use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    assert _children_alive(pids) == []
