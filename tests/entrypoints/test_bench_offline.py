"""`pagedllm bench latency` and `bench throughput` end to end on a tiny model: their JSON and their PNG plots."""
from __future__ import annotations

import json

import pytest
from tiny_models import make_tiny_model

from pagedllm.entrypoints.cli.main import main

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("bench") / "llama")


def test_bench_latency_writes_json_and_a_plot(tiny_path, tmp_path, capsys):
    out, png = tmp_path / "lat.json", tmp_path / "lat.png"
    argv = ["bench", "latency", "--model", tiny_path, "--device", "cpu", "--max-model-len", "64", "--skip-tokenizer-init",
            "--batch-size", "1,2,4", "--input-len", "8", "--output-len", "4", "--num-iters", "1",
            "--num-iters-warmup", "1", "--output-json", str(out), "--plot", str(png)]
    assert main(argv) == 0
    rows = json.loads(out.read_text())["results"]
    assert [r["batch_size"] for r in rows] == [1, 2, 4]
    # TPOT is (full run - TTFT run) / (output - 1): on a busy 2-core machine a tiny model's difference can
    # be noise of either sign, so only the directly timed figures are checked for sign.
    assert all(r["ttft_ms"] > 0 and r["e2e_ms"] > 0 and r["output_tokens_per_s"] > 0 for r in rows)
    assert all(len(r["ttft_runs_ms"]) == 1 and isinstance(r["tpot_ms"], float) for r in rows)
    assert png.read_bytes()[:8] == PNG and png.stat().st_size > 10_000
    assert "plot written to" in capsys.readouterr().out


def test_bench_throughput_writes_json_and_a_plot(tiny_path, tmp_path):
    out, png = tmp_path / "tp.json", tmp_path / "tp.png"
    argv = ["bench", "throughput", "--model", tiny_path, "--device", "cpu", "--max-model-len", "64", "--skip-tokenizer-init",
            "--num-prompts", "12", "--input-len", "10", "--output-len", "6", "--random-range-ratio", "0.5",
            "--no-progress", "--output-json", str(out), "--plot", str(png)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert result["num_prompts"] == 12 and result["num_output_tokens"] > 0
    assert result["output_tokens_per_s"] > 0 and result["requests_per_s"] > 0
    assert png.read_bytes()[:8] == PNG and png.stat().st_size > 10_000


def test_a_plot_without_matplotlib_fails_before_the_run(monkeypatch, tmp_path):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.split(".")[0] == "matplotlib":
            raise ImportError("no matplotlib here")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    from pagedllm.entrypoints.bench.plots import require_matplotlib

    require_matplotlib(None)  # no plot asked: nothing needed
    with pytest.raises(SystemExit, match=r"--plot .*x\.png needs matplotlib.*pagedllm\[bench\]"):
        require_matplotlib(str(tmp_path / "x.png"))
