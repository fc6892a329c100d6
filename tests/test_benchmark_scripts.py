"""The scripts under benchmarks/ mostly need a GPU to run, but each must at least import and parse its
command line here: `--help` runs every import and the argument parser, and exits before any work."""
from __future__ import annotations

import json
import os
import pathlib
import runpy
import sys

import pytest

BENCH = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"
SCRIPTS = sorted(p.name for p in BENCH.glob("*.py") if "argparse" in p.read_text())


def test_every_benchmark_with_options_is_checked():
    assert {"attention_kernels.py", "memory_ceilings.py", "top_p_kernel.py", "h200_throughput.py",
            "h200_moe.py", "moe_kernels.py"} <= set(SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_benchmark_script_imports_and_parses_its_options(script, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCH))  # as `python3 benchmarks/<script>` puts its folder first
    monkeypatch.setattr(sys, "argv", [script, "--help"])
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(BENCH / script), run_name="__main__")
    assert done.value.code == 0
    assert "usage:" in capsys.readouterr().out


@pytest.mark.slow
def test_h200_moe_runs_every_section_on_tiny_configs(tmp_path, monkeypatch):
    """The MoE benchmark's whole path (sections in their own processes, HF included, float8 Mixtral experts,
    the summary) on tiny configs of the same families, on the CPU."""
    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv("PYTHONPATH", str(BENCH.parent) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    mod = runpy.run_path(str(BENCH / "h200_moe.py"))
    res = mod["main"](["--smoke", "--out", str(tmp_path)])
    for name in ("qwen", "hf", "mixtral"):
        assert "error" not in res["results"][name] and "timeout" not in res["results"][name], res["results"][name]
    s = res["summary"]
    assert s["qwen_out_tok_per_s"] > 0 and s["mixtral_out_tok_per_s"] > 0 and s["subset_ratio_vs_hf"] > 0
    mix = res["results"]["mixtral"]["bytes"]
    assert mix["expert_dtype"] == "torch.float8_e4m3fn" and mix["num_experts"] == 4 and mix["top_k"] == 2
    # one float8 expert of the tiny Mixtral: gate/up [2*96, 64] and down [64, 96] bytes, plus a float32 scale a row
    assert mix["expert_bytes"] == 3 * 96 * 64 + 4 * (2 * 96 + 64)
    assert json.loads((tmp_path / "summary.json").read_text())["settings"]["smoke"] is True


def test_h200_moe_touched_experts_and_bad_options(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    mod = runpy.run_path(str(BENCH / "h200_moe.py"))
    touched = mod["expected_touched"]
    assert touched(128, 8, 1) == pytest.approx(8) and touched(8, 2, 1) == pytest.approx(2)
    assert touched(8, 2, 256) == pytest.approx(8) and 8 < touched(128, 8, 4) < 32
    for argv, msg in ((["--sections", "qwen,llama"], "unknown"), (["--hf-prompts", "300"], "exceeds --prompts"),
                      (["--layers", "0"], "must be >= 1")):
        with pytest.raises(SystemExit):
            mod["parse_args"](argv)


def test_moe_kernels_tuned_table_merges_and_tokens_parse(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    mod = runpy.run_path(str(BENCH / "moe_kernels.py"))
    assert mod["parse_tokens"](["1", "16,256"]) == [1, 16, 256]
    with pytest.raises(SystemExit, match="'0' is not a whole number >= 1"):
        mod["parse_tokens"](["1,0"])
    pkg, out = tmp_path / "pkg", tmp_path / "out"
    a, b = dict(BLOCK_M=16), dict(BLOCK_M=64)
    mod["write_tuned"]({"E=8,N=4,K=2": {"1": a}}, "Some GPU", [str(pkg), str(out)])
    # a later sweep of another count keeps the first one, in the package's table and in the copy under --out
    paths = mod["write_tuned"]({"E=8,N=4,K=2": {"256": b}}, "Some GPU", [str(pkg), str(tmp_path / "out2")])
    for path in paths:
        table = json.loads(pathlib.Path(path).read_text())
        assert table["device"] == "Some GPU" and table["shapes"]["E=8,N=4,K=2"] == {"1": a, "256": b}
    assert pathlib.Path(paths[0]).name == "Some_GPU.json"
