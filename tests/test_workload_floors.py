"""The floor model of benchmarks/workload_floors.py: model bytes from a config, and a hand-counted replay."""
from __future__ import annotations

import pathlib
import sys

import pytest

BENCH = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture()
def wf(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import workload_floors

    yield workload_floors
    sys.modules.pop("workload_floors", None)


def test_model_figures_match_the_shapes_bytes(wf) -> None:
    llama = wf.model_figures(str(BENCH / "shapes" / "llama-3-8b"))
    assert llama["weight_bytes"] == 2 * (32 * (6144 * 4096 + 4096 * 4096 + 3 * 4096 * 14336) + 128256 * 4096)
    assert llama["kv_bytes_per_token"] == 128 * 1024
    qwen = wf.model_figures(str(BENCH / "shapes" / "qwen3-0.6b"))
    assert qwen["kv_bytes_per_token"] == 112 * 1024
    assert qwen["attn_flops_per_pair"] == 4 * 128 * 16 * 28


def test_floors_count_each_decode_step_by_hand(wf) -> None:
    fig = {"weight_bytes": 100, "flops_per_token": 10, "kv_bytes_per_token": 1, "attn_flops_per_pair": 0}
    # Requests (prompt 4, 3 outputs) and (prompt 2, 2 outputs): decode steps 1 and 2 (the first tokens come
    # from the prefill); step 1 runs both (contexts 5 and 3), step 2 the first alone (context 6).
    res = wf.floors([(4, 3), (2, 2)], fig, read_bps=1.0, flops=1.0, fixed_s=0.5)
    assert res["prefill_s"] == 6 * 10
    assert res["decode_steps"] == 2
    # Each step: max(kv + weights, products) overlapped; kv then max(weights, products) in series.
    assert res["overlap_s"] == 60 + max(8 + 100, 20) + max(6 + 100, 10)
    assert res["serial_s"] == 60 + (8 + 100) + (6 + 100)
    assert res["serial_fixed_s"] == res["serial_s"] + 2 * 0.5
