"""benchmarks/serve_latency.py end to end on the CPU: its raw-socket client against a real `pagedllm serve`."""
from __future__ import annotations

import json
import math
import runpy
import sys
from pathlib import Path

import pytest
from serve_helpers import make_model

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.slow
def test_serve_latency_measures_client_and_server_ttft(tmp_path, monkeypatch, capsys):
    model = make_model("mistral", tmp_path / "model")
    out = tmp_path / "lat.json"
    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.setattr(sys, "argv", [
        "serve_latency.py", "--model", model, "--vocab", "32000", "--requests", "6", "--warmup", "2",
        "--input-len", "40", "--max-tokens", "3", "--gap-s", "0", "--json", str(out),
        "--serve-flags", "--device cpu --dtype float32 --max-model-len 256 --kv-cache-memory-bytes 16777216",
    ])
    runpy.run_path(str(BENCH / "serve_latency.py"), run_name="__main__")
    res = json.loads(out.read_text())
    assert res["requests"] == 6
    client, server = res["client_ttft_ms"], res["server_ttft_mean_ms"]
    # The server's TTFT (arrival in the front end to its first token there) lies inside the client's.
    assert 0 < server and math.isfinite(res["client_minus_server_mean_ms"]) and res["client_minus_server_mean_ms"] > 0
    assert 0 < client["min"] <= client["median"] <= res["e2e_ms"]["median"]
    assert "client TTFT median" in capsys.readouterr().out
