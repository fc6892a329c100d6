"""The `slow` tests: left out by a plain `pytest`, included by the README's test command (the one CI runs)."""
from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# A module whose tests are all marked slow, and cheap to collect.
SLOW_MODULE = "tests/models/test_gemma3_gguf.py"


def _readme_pytest_args() -> list[str]:
    block = re.search(r"<!-- test-command -->(.*?)<!-- /test-command -->", (REPO / "README.md").read_text(), re.S)
    assert block, "README.md has no <!-- test-command --> block"
    command = next(line for line in block.group(1).splitlines() if "pytest" in line)
    words = shlex.split(command.split("&&")[-1])
    return words[words.index("pytest") + 1 :]


def _collects_any(*args: str) -> bool:
    rc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-p", "no:cacheprovider", *args, SLOW_MODULE],
        cwd=REPO, capture_output=True, timeout=240,
    ).returncode
    assert rc in (0, 5), f"pytest {' '.join(args)} failed to collect {SLOW_MODULE} (exit {rc})"
    return rc == 0  # 5: no test collected


@pytest.mark.timeout(300)
def test_plain_pytest_leaves_slow_tests_out_and_the_readme_command_runs_them() -> None:
    pytest.importorskip("gguf")
    assert not _collects_any()
    assert _collects_any(*_readme_pytest_args())
