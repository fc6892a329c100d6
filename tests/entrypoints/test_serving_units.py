"""Server parts without a server: the core wire schema, the core busy loop over real ZMQ sockets with
a fake core, the guard middleware, error translation, Prometheus metrics and the lazy imports."""
from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import httpx
import msgspec
import pytest
import zmq

from pagedllm.core.request import RequestStatus
from pagedllm.core.scheduler import SchedulerStats
from pagedllm.core.scheduler_output import EngineCoreOutput, LogprobsLists
from pagedllm.engine import core_messages as m
from pagedllm.sampling_params import SamplingParams

REPO_ROOT = Path(__file__).resolve().parents[2]


# ---- wire schema ----------------------------------------------------------------------------------
def test_add_request_round_trip_keeps_every_sampling_field():
    params = SamplingParams(temperature=0.7, top_k=5, stop=["x", "yz"], stop_token_ids=[7], logit_bias={3: 1.5},
                            max_tokens=9, min_tokens=2, logprobs=3, seed=4, allowed_token_ids=[1, 2, 3])
    params.all_stop_token_ids = {2, 7}
    msg = m.AddRequest("r1", [1, 2, 3], m.params_to_dict(params), 42, [2])
    back = m.input_decoder().decode(m.input_encoder().encode(msg))
    assert isinstance(back, m.AddRequest) and back.prompt_token_ids == [1, 2, 3] and back.seed == 42
    rebuilt = m.params_from_dict(back.params)
    assert rebuilt == params and rebuilt.all_stop_token_ids == {2, 7} and rebuilt.logit_bias == {3: 1.5}


def test_core_outputs_round_trip():
    out = EngineCoreOutput("a", [5, 6], LogprobsLists([[5, 1]], [[-0.1, -2.0]], [1]), None, "stop", "yz", 16)
    stats = SchedulerStats(num_running_reqs=3, num_waiting_reqs=1, kv_cache_usage=0.25, prefix_cache_hits=16)
    msg = m.CoreOutputs([out], stats, {"a": 0.5})
    back = m.output_decoder().decode(m.output_encoder().encode(msg))
    assert back == msg and back.outputs[0].finished


def test_decoder_rejects_unknown_messages():
    with pytest.raises(msgspec.ValidationError):
        m.input_decoder().decode(msgspec.msgpack.encode(["exec", "import os"]))
    with pytest.raises(msgspec.ValidationError):
        m.output_decoder().decode(msgspec.msgpack.encode({"anything": 1}))


# ---- the core busy loop ---------------------------------------------------------------------------
class _FakeCore:
    """Finishes every request after one token; records aborts."""

    num_blocks = 8

    def __init__(self):
        self.requests = {}
        self.aborted = []

    def add_request(self, req):
        self.requests[req.request_id] = req

    def abort_requests(self, ids):
        for rid in ids:
            if self.requests.pop(rid, None) is not None:
                self.aborted.append(rid)

    def finish_by_stop_string(self, rid, stop):
        self.requests.pop(rid, None)

    def has_unfinished_requests(self):
        return bool(self.requests)

    def submit_delay_s(self):
        return 0.0

    def step(self):
        outs = []
        for rid, req in list(self.requests.items()):
            req.first_scheduled_time = req.arrival_time + 0.01
            if req.prompt_token_ids[0] == 0:  # marker: a request that never finishes
                continue
            req.status = RequestStatus.FINISHED_LENGTH_CAPPED
            outs.append(EngineCoreOutput(rid, [req.prompt_token_ids[-1] + 1], finish_reason="length"))
            del self.requests[rid]
        return outs

    def stats(self):
        return SchedulerStats(num_running_reqs=len(self.requests))

    def reset_prefix_cache(self):
        return True


def test_busy_loop_serves_requests_aborts_and_utilities():
    from pagedllm.engine.core_proc import _BusyLoop

    with tempfile.TemporaryDirectory() as tmp:
        ctx = zmq.Context()
        fe_in, fe_out = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
        fe_in.bind(f"ipc://{tmp}/in")
        fe_out.bind(f"ipc://{tmp}/out")
        core_in, core_out = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        core_in.connect(f"ipc://{tmp}/in")
        core_out.connect(f"ipc://{tmp}/out")
        core = _FakeCore()
        loop = _BusyLoop(core, core_in, core_out, parent_pid=__import__("os").getppid())
        thread = threading.Thread(target=loop.run, daemon=True)
        thread.start()
        enc, dec = m.input_encoder(), m.output_decoder()
        params = m.params_to_dict(SamplingParams(max_tokens=1))

        def recv():
            assert fe_out.poll(10_000)
            return dec.decode(fe_out.recv())

        fe_in.send(enc.encode(m.AddRequest("done", [1, 2], params, 0, [2])))
        msg = recv()
        while not msg.outputs:
            msg = recv()
        assert msg.outputs[0].new_token_ids == [3] and msg.queue_times["done"] == pytest.approx(0.01)
        fe_in.send(enc.encode(m.AddRequest("stuck", [0], params, 0, [])))
        fe_in.send(enc.encode(m.Abort(["stuck"])))
        fe_in.send(enc.encode(m.UtilityCall(7, "stats")))
        fe_in.send(enc.encode(m.UtilityCall(8, "os.system", ["true"])))
        results = {}
        while len(results) < 2:
            msg = recv()
            if isinstance(msg, m.UtilityResult):
                results[msg.call_id] = msg
        assert results[7].error is None and results[7].result["num_running_reqs"] in (0, 1)
        assert "unknown utility method" in results[8].error
        fe_in.send(enc.encode(m.Shutdown()))
        thread.join(10)
        assert not thread.is_alive() and core.aborted == ["stuck"]
        for s in (fe_in, fe_out, core_in, core_out):
            s.close(linger=0)
        ctx.term()


# ---- guard middleware -----------------------------------------------------------------------------
async def _echo_app(scope, receive, send):
    body = b""
    while True:
        msg = await receive()
        body += msg.get("body", b"")
        if not msg.get("more_body"):
            break
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": body})


def _guarded_client(**kwargs) -> httpx.AsyncClient:
    from pagedllm.entrypoints.openai.http_utils import GuardMiddleware

    app = GuardMiddleware(_echo_app, **kwargs)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def test_guard_middleware():
    asyncio.run(_guard_checks())


async def _guard_checks():
    async with _guarded_client(api_keys=["k1", "k2"], max_body_bytes=100, max_header_bytes=500) as c:
        ok = {"Authorization": "Bearer k2"}
        r = await c.post("/x", content=b"hello", headers=ok)
        assert r.status_code == 200 and r.content == b"hello"
        assert (await c.post("/x", content=b"hello", headers={"Authorization": "Bearer k3"})).status_code == 401
        assert (await c.post("/x", content=b"hello", headers={"Authorization": "k1"})).status_code == 401
        assert (await c.get("/health")).status_code == 200
        r = await c.post("/x", content=b"a" * 101, headers=ok)
        assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"

        async def gen():
            for _ in range(3):
                yield b"a" * 40

        assert (await c.post("/x", content=gen(), headers=ok)).status_code == 413
        r = await c.get("/x", headers={**ok, "X-Big": "b" * 600})
        assert r.status_code == 431 and set(r.json()["error"]) == {"message", "type", "param", "code"}


# ---- error translation ----------------------------------------------------------------------------
def test_value_errors_become_400s_naming_the_field():
    from pagedllm.entrypoints.openai.errors import from_value_error

    try:
        SamplingParams(logprobs=30)
    except ValueError as e:
        err = from_value_error(e, ["logprobs"], {"logprobs": "top_logprobs"})
    assert err.status == 400 and err.param == "top_logprobs" and err.message.startswith("top_logprobs must be")
    assert from_value_error(ValueError("something odd"), ["n"]).param is None


# ---- metrics --------------------------------------------------------------------------------------
def test_prometheus_logger_counters_and_dashboard_names():
    from pagedllm.metrics.prometheus import PrometheusStatLogger

    a, b = PrometheusStatLogger("m"), PrometheusStatLogger("m")  # separate registries: no clash
    a.record_scheduler_stats(SchedulerStats(num_running_reqs=2, prefix_cache_queries=32, prefix_cache_hits=16, num_preemptions=1))
    a.record_scheduler_stats(SchedulerStats(num_running_reqs=0, prefix_cache_queries=48, prefix_cache_hits=16, num_preemptions=1))
    a.record_finished("length", 1.0)
    a.record_first_token(0.1)
    a.record_prefill_time(0.08)
    text = a.exposition()[0].decode()
    assert 'pagedllm:request_prefill_time_seconds_count{engine="0",model_name="m"} 1.0' in text
    assert 'pagedllm:prefix_cache_queries_total{engine="0",model_name="m"} 48.0' in text
    assert 'pagedllm:num_preemptions_total{engine="0",model_name="m"} 1.0' in text
    assert 'pagedllm:num_requests_running{engine="0",model_name="m"} 0.0' in text
    assert 'pagedllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 1.0' in text
    assert "pagedllm:prefix_cache_queries_total" in b.exposition()[0].decode()
    # A second data-parallel core has series of its own.
    c = PrometheusStatLogger("m", num_engines=2)
    c.record_generation_tokens(3, engine=1)
    text_c = c.exposition()[0].decode()
    assert 'pagedllm:generation_tokens_total{engine="1",model_name="m"} 3.0' in text_c
    assert 'pagedllm:generation_tokens_total{engine="0",model_name="m"} 0.0' in text_c
    dashboard = json.loads((REPO_ROOT / "docs/grafana/pagedllm.json").read_text())
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p["targets"])
    names = set(re.findall(r"pagedllm:[a-z_]+", exprs))
    assert len(names) >= 12
    for name in names:
        assert name in text, name


# ---- imports --------------------------------------------------------------------------------------
def test_pagedllm_imports_without_server_packages():
    code = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {'fastapi', 'uvicorn', 'starlette', 'zmq', 'msgspec', 'prometheus_client', 'openai', 'httpx'}:
            raise ImportError('blocked ' + name)
sys.meta_path.insert(0, Block())
import pagedllm
from pagedllm.entrypoints.cli.main import _build_parser
args = _build_parser().parse_args(['serve', 'some-model', '--port', '9'])
assert args.model_tag == 'some-model' and args.port == 9
print('ok')
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_core_start_failure_is_reported_by_the_core(tmp_path):
    from pagedllm.engine.core_client import CoreClient
    from pagedllm.engine_args import EngineArgs

    (tmp_path / "config.json").write_text("{}")  # a model directory the core cannot build
    client = CoreClient(EngineArgs(model=str(tmp_path), device="cpu"))
    with pytest.raises(RuntimeError, match="engine core failed to start"):
        client.wait_ready(timeout_s=120)
    assert not client.proc.is_alive()


def test_serve_submits_just_in_time_by_default_and_offline_does_not():
    from pagedllm.engine_args import EngineArgs
    from pagedllm.entrypoints.cli.main import _build_parser

    parser = _build_parser()
    assert parser.parse_args(["serve", "m"]).submit_just_in_time is True
    assert parser.parse_args(["serve", "m", "--no-submit-just-in-time"]).submit_just_in_time is False
    assert EngineArgs.from_cli_args(parser.parse_args(["serve", "m"])).submit_just_in_time is True
    assert EngineArgs(model="m").submit_just_in_time is False
    assert parser.parse_args(["bench", "throughput", "--model", "m"]).submit_just_in_time is False
