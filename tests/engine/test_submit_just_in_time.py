"""Just-in-time submission: the engine core waits for the device only behind a measured decode step, with nobody waiting."""
from __future__ import annotations

import pytest
from tiny_models import make_tiny_model

from pagedllm import SamplingParams
from pagedllm.core.request import Request
from pagedllm.core.scheduler_output import ModelRunnerOutput
from pagedllm.engine import engine_core as ec
from pagedllm.engine_args import EngineArgs
from pagedllm.executor.base import Executor


class _Clock:
    """A perf_counter that moves only when told to."""

    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now


class _TimedExecutor(Executor):
    """Samples token 7 for every request that reaches its last known token; each step 'took' device_s."""

    def __init__(self, config, device_s: float | None) -> None:
        super().__init__(config)
        self.device_s = device_s

    def determine_num_blocks(self) -> int:
        return 64

    def initialize_cache(self, num_blocks: int) -> None:
        pass

    def execute_model(self, so) -> ModelRunnerOutput:
        ids = list(so.num_scheduled_tokens)
        return ModelRunnerOutput(req_ids=ids, sampled_token_ids=[[7] for _ in ids], device_time_s=self.device_s)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("jit") / "llama")


def _core(path: str, device_s: float | None, jit: bool = True) -> ec.EngineCore:
    args = EngineArgs(model=path, device="cpu", async_scheduling=True, submit_just_in_time=jit, max_model_len=64)
    config = args.create_engine_config()
    return ec.EngineCore(config, _TimedExecutor(config, device_s))


def _add(core: ec.EngineCore, rid: str) -> None:
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    core.add_request(Request(rid, [3, 4, 5, 6, 8], params, 0, eos_token_ids=frozenset()))


def test_waits_only_behind_a_measured_decode_step(tiny_path, monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(ec, "time", clock)
    core = _core(tiny_path, 0.004)
    _add(core, "a")
    _add(core, "b")
    core.step()  # submits the prefill of both
    assert core.submit_delay_s() == 0.0  # a prefill step is in flight: no estimate applies
    core.step()  # submits decode (batch 2); takes the prefill's output
    assert core.submit_delay_s() == 0.0  # no batch-2 decode measured yet
    core.step()  # takes the first decode's output: 4 ms measured for a batch of 2
    # The device started the step in flight when the previous output arrived (clock 100.0); it should end
    # 4 ms later, and the next step is due the safety margin (host time is 0 on this clock) before that.
    assert core.submit_delay_s() == pytest.approx(0.004 - ec._JIT_SAFETY_S)
    clock.now += 0.002
    assert core.submit_delay_s() == pytest.approx(0.002 - ec._JIT_SAFETY_S)
    clock.now += 0.01
    assert core.submit_delay_s() == 0.0  # overdue: schedule at once
    clock.now -= 0.012
    _add(core, "c")
    assert core.submit_delay_s() == 0.0  # someone is waiting: they go in the next step regardless


@pytest.mark.parametrize(("device_s", "jit"), [(None, True), (0.004, False)])
def test_never_waits_without_device_times_or_when_off(tiny_path, device_s, jit):
    core = _core(tiny_path, device_s, jit)
    _add(core, "a")
    for _ in range(5):
        core.step()
        assert core.submit_delay_s() == 0.0


def test_outputs_unchanged_on_cpu(tiny_path):
    # On CPU nothing is timed, so the flag must change nothing at all; the same tokens as synchronous.
    from pagedllm import LLM

    prompts = [{"prompt_token_ids": [3, 9, 27, 81]}, {"prompt_token_ids": [5, 25]}]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = {}
    for kw in ({"async_scheduling": False}, {"async_scheduling": True, "submit_just_in_time": True}):
        llm = LLM(model=tiny_path, device="cpu", dtype="float32", max_model_len=64, skip_tokenizer_init=True, **kw)
        outs[len(kw)] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outs[1] == outs[2]


class _WaitingExecutor(_TimedExecutor):
    """Each submit queues its forward pass after 0.3 ms of host work, then blocks 3 ms on the previous
    step and spends 0.2 ms launching sampling, as the GPU runner does."""

    def __init__(self, config, device_s, clock) -> None:
        super().__init__(config, device_s)
        self.clock = clock

    def submit(self, so, defer_sampling=False) -> float:
        super().submit(so, defer_sampling)
        self.clock.now += 0.0003 + 0.003 + 0.0002
        return 0.0003


def test_host_time_excludes_the_wait_for_the_previous_step(tiny_path, monkeypatch):
    # Counting the wait as host time doubled it into the margin, which then swallowed the whole step;
    # the work after the forward pass is queued does not delay the device either.
    clock = _Clock()
    monkeypatch.setattr(ec, "time", clock)
    args = EngineArgs(model=tiny_path, device="cpu", async_scheduling=True, submit_just_in_time=True, max_model_len=64)
    config = args.create_engine_config()
    core = ec.EngineCore(config, _WaitingExecutor(config, 0.004, clock))
    _add(core, "a")
    _add(core, "b")
    for _ in range(12):
        core.step()
    assert core._submit_host_s == pytest.approx(0.0003, rel=0.05)
    # The output arrived when the last submit returned; 4 ms of device time from then, less the margin.
    assert core.submit_delay_s() == pytest.approx(0.004 - 2 * core._submit_host_s - ec._JIT_SAFETY_S)


def test_large_decode_batches_never_wait(tiny_path, monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(ec, "time", clock)
    args = EngineArgs(model=tiny_path, device="cpu", async_scheduling=True, submit_just_in_time=True,
                      max_model_len=64, max_num_seqs=64)
    config = args.create_engine_config()
    core = ec.EngineCore(config, _TimedExecutor(config, 0.004))
    for i in range(ec._JIT_MAX_BATCH + 1):
        _add(core, f"r{i}")
    for _ in range(4):
        core.step()
        assert not core.scheduler.waiting
        assert core.submit_delay_s() == 0.0  # a decode batch over the limit: schedule at once
    assert core._decode_device_s[ec._JIT_MAX_BATCH + 1] == pytest.approx(0.004)  # measured all the same
