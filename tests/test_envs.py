"""pagedllm/envs.py is the one reader of PAGEDLLM_* variables, and the README lists exactly what it defines."""
from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

from pagedllm import envs

ROOT = Path(__file__).resolve().parent.parent
NAME = re.compile(r"PAGEDLLM_[A-Z0-9_]+")

# Modules that may touch os.environ for variables that are not pagedllm's own, and why.
OTHER_ENVIRONMENT_READERS = {
    "pagedllm/envs.py": "pagedllm's own variables",
    "pagedllm/kernels/launch.py": "TRITON_INTERPRET, once (kernels may not import pagedllm.envs)",
    "pagedllm/kernels/cpu/build.py": "XDG_CACHE_HOME, the default folder of compiled CPU kernels",
    "pagedllm/model_loader/hub.py": "Hugging Face's HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE",
    "pagedllm/engine/core_proc.py": "sets library variables for the engine core process",
    "pagedllm/engine/dp_client.py": "CUDA_VISIBLE_DEVICES: each data-parallel core's devices, set for its spawn",
}


def _sources() -> list[Path]:
    return sorted([*(ROOT / "pagedllm").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")])


@pytest.fixture
def reload_envs(monkeypatch):
    """Re-reads the environment into pagedllm.envs, and again after the test with the environment restored."""
    yield lambda: importlib.reload(envs)
    monkeypatch.undo()
    importlib.reload(envs)


def test_readme_lists_exactly_the_variables_envs_defines() -> None:
    readme = (ROOT / "README.md").read_text()
    table = readme.split("<!-- env-vars -->", 1)[1].split("<!-- /env-vars -->", 1)[0]
    rows = {}
    for line in table.strip().splitlines()[2:]:
        name, effect = (cell.strip() for cell in line.strip().strip("|").split("|"))
        rows[name.strip("`")] = effect
    assert rows == envs.DOCS
    assert set(envs.DOCS) == {name for name in vars(envs) if NAME.fullmatch(name)}


def _is_environ(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ"
            or isinstance(node, ast.Name) and node.id == "environ")


def _pagedllm_reads(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, name) of each read of a PAGEDLLM_* variable: ``os.environ.get(name)``, ``os.getenv(name)``,
    ``os.environ[name]``, ``name in os.environ``. Setting one for a child process is not a read."""
    def named(node: ast.AST) -> str | None:
        ok = isinstance(node, ast.Constant) and isinstance(node.value, str) and NAME.fullmatch(node.value)
        return node.value if ok else None

    found = []
    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Call) and node.args and isinstance(node.func, (ast.Attribute, ast.Name)):
            attr = node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id
            if attr == "getenv" or attr == "get" and isinstance(node.func, ast.Attribute) and _is_environ(node.func.value):
                key = named(node.args[0])
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _is_environ(node.value):
            key = named(node.slice)
        elif isinstance(node, ast.Compare) and any(_is_environ(c) for c in node.comparators):
            key = named(node.left)
        if key:
            found.append((node.lineno, key))
    return found


def test_the_read_finder_sees_every_form() -> None:
    src = ("import os\nfrom os import environ, getenv\n"
           "a = os.environ.get('PAGEDLLM_A')\nb = os.getenv('PAGEDLLM_B')\nc = os.environ['PAGEDLLM_C']\n"
           "d = 'PAGEDLLM_D' in os.environ\ne = environ.get('PAGEDLLM_E', '1')\nf = getenv('PAGEDLLM_F')\n"
           "env = {'PAGEDLLM_G': '0'}\nos.environ['PAGEDLLM_H'] = '1'\nhelp = 'PAGEDLLM_I=0 turns it off'\n")
    assert [name for _, name in _pagedllm_reads(ast.parse(src))] == [f"PAGEDLLM_{c}" for c in "ABCDEF"]


def test_no_module_but_envs_reads_a_pagedllm_variable() -> None:
    offenders = []
    for path in _sources():
        rel = path.relative_to(ROOT).as_posix()
        if rel != "pagedllm/envs.py":
            offenders += [f"{rel}:{line}: {name}" for line, name in _pagedllm_reads(ast.parse(path.read_text(), rel))]
    assert not offenders, "read these through pagedllm.envs:\n" + "\n".join(offenders)


def test_the_environment_is_read_only_where_listed() -> None:
    readers = set()
    for path in (ROOT / "pagedllm").rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            if (isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv")
                    or isinstance(node, ast.alias) and node.name in ("environ", "getenv")):
                readers.add(rel)
    assert readers <= set(OTHER_ENVIRONMENT_READERS), sorted(readers - set(OTHER_ENVIRONMENT_READERS))
    # Launches are a hot path: the kernels ask launch.triton_interpreted (read once), never the environment.
    mentions = {p.relative_to(ROOT).as_posix() for p in (ROOT / "pagedllm").rglob("*.py")
                if '"TRITON_INTERPRET"' in p.read_text()}
    assert mentions == {"pagedllm/kernels/launch.py"}


def test_values_come_from_the_environment_at_import(reload_envs, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("PAGEDLLM_CACHE", str(tmp_path / "c"))
    monkeypatch.setenv("PAGEDLLM_API_KEY", "k")
    monkeypatch.setenv("PAGEDLLM_GC_FREEZE", "0")
    monkeypatch.delenv("PAGEDLLM_PDL", raising=False)
    reload_envs()
    assert (envs.PAGEDLLM_CACHE, envs.PAGEDLLM_API_KEY, envs.PAGEDLLM_GC_FREEZE, envs.PAGEDLLM_PDL) == (
        tmp_path / "c", "k", False, True)
    monkeypatch.delenv("PAGEDLLM_CACHE")
    monkeypatch.setenv("PAGEDLLM_API_KEY", "")
    reload_envs()
    assert envs.PAGEDLLM_CACHE == Path.home() / ".cache" / "pagedllm" / "models" and envs.PAGEDLLM_API_KEY is None


def test_a_flag_that_is_not_0_or_1_is_refused_by_name(reload_envs, monkeypatch) -> None:
    monkeypatch.setenv("PAGEDLLM_PDL", "off")
    with pytest.raises(ValueError, match=r"PAGEDLLM_PDL='off': expected 0 or 1"):
        reload_envs()
