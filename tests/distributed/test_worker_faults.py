"""A worker that dies or raises fails the multiprocess engine fast, naming the rank, and leaves no process behind."""
from __future__ import annotations

import os
import signal
import time

import psutil
import pytest
from parallel_cases import COMMON, make_edge_model
from safetensors.torch import load_file, save_file

from pagedllm import SamplingParams
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine_args import EngineArgs
from pagedllm.executor.multiproc import WorkerFailedError


def _children() -> set[int]:
    """Live processes below this one, but for multiprocessing's resource tracker (one per interpreter, kept)."""
    out = set()
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(p.cmdline()):
                out.add(p.pid)
        except psutil.NoSuchProcess:
            pass
    return out


def test_killing_a_worker_mid_generation_fails_the_engine_within_10s(tmp_path):
    path = make_edge_model("llama", tmp_path / "llama")
    before = _children()
    engine = LLMEngine.from_engine_args(EngineArgs(model=path, tensor_parallel_size=2, **COMMON))
    workers = engine.engine_core.executor.procs
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"r{i}", {"prompt_token_ids": [5 + i, 9, 13]}, params)
    for _ in range(3):
        engine.step()
    assert engine.has_unfinished_requests()
    os.kill(workers[1].pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(WorkerFailedError, match=r"worker rank 1 failed: process \d+ killed by SIGKILL"):
        while engine.has_unfinished_requests():
            engine.step()
    assert time.monotonic() - t0 < 10
    # The failure stays: the next call fails at once, and no worker is left running.
    with pytest.raises(WorkerFailedError):
        engine.engine_core.executor.execute_model(None)
    engine.shutdown()
    assert not any(psutil.pid_exists(p.pid) for p in workers)
    assert _children() <= before


def test_a_worker_that_raises_at_start_up_is_named_with_its_error(tmp_path):
    path = make_edge_model("llama", tmp_path / "llama")
    weights = load_file(os.path.join(path, "model.safetensors"))
    del weights["model.layers.2.mlp.down_proj.weight"]  # held by the second stage only
    save_file(weights, os.path.join(path, "model.safetensors"))
    before = _children()
    t0 = time.monotonic()
    with pytest.raises(WorkerFailedError, match=r"worker rank 1 failed: ValueError: checkpoint .* lacks 1 parameters"
                                                r".*model\.layers\.2\.mlp\.down_proj\.weight.* \(base\.py:\d+ in "):
        LLMEngine.from_engine_args(EngineArgs(model=path, pipeline_parallel_size=2, **COMMON))
    assert time.monotonic() - t0 < 30
    assert _children() <= before
