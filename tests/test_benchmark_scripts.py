"""The scripts under benchmarks/ mostly need a GPU to run, but each must at least import and parse its
command line here: `--help` runs every import and the argument parser, and exits before any work."""
from __future__ import annotations

import pathlib
import runpy
import sys

import pytest

BENCH = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"
SCRIPTS = sorted(p.name for p in BENCH.glob("*.py") if "argparse" in p.read_text())


def test_every_benchmark_with_options_is_checked():
    assert {"attention_kernels.py", "memory_ceilings.py", "top_p_kernel.py", "h200_throughput.py"} <= set(SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_benchmark_script_imports_and_parses_its_options(script, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCH))  # as `python3 benchmarks/<script>` puts its folder first
    monkeypatch.setattr(sys, "argv", [script, "--help"])
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(BENCH / script), run_name="__main__")
    assert done.value.code == 0
    assert "usage:" in capsys.readouterr().out
