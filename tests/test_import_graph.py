"""The pagedllm package's imports point one way: no cycles, arrows only down the layers, a torch-free
core, self-contained kernels.

The graph is read from the source with ast. Every ``import`` and ``from ... import`` of a pagedllm module
counts, wherever it stands (module level, inside a function, under ``TYPE_CHECKING``): a function-level
import still runs, and a type-only one is still a dependency of the code that names the type. So does a
string that names a pagedllm module in full (``"pagedllm.model_loader.dummy"``): the registries import
what they name by ``importlib``, later.
``from pkg import name`` is an arrow to ``pkg.name`` when that is a module, else to ``pkg`` itself, i.e.
to the package's ``__init__`` and through it to whatever that ``__init__`` imports (re-exports are real
arrows). Python also runs every enclosing package's ``__init__`` before a module; that arrow is not
drawn (it would make each re-exporting package a cycle with its children), and a subprocess checks its
effect where it matters: importing every core module must leave torch unloaded.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from functools import cache
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "pagedllm"

# The layers, top first: a module may import its own unit (a top-level package or module of pagedllm) and
# units of lower rows only. Units on one row do not import each other. A new unit needs a row here.
LAYERS = (
    ("pagedllm",),  # the package's __init__: the public API, which nothing inside imports
    ("pagedllm.entrypoints",),
    ("pagedllm.engine", "pagedllm.metrics"),
    ("pagedllm.engine_args",),
    ("pagedllm.executor",),
    ("pagedllm.worker",),
    ("pagedllm.sample", "pagedllm.structured_output"),
    ("pagedllm.model_loader",),
    ("pagedllm.models",),
    ("pagedllm.layers",),
    ("pagedllm.attention", "pagedllm.distributed"),
    ("pagedllm.kernels",),
    ("pagedllm.config", "pagedllm.vllm_only_args"),
    ("pagedllm.core", "pagedllm.graph_config", "pagedllm.chat_templates"),
    ("pagedllm.sampling_params", "pagedllm.outputs", "pagedllm.envs", "pagedllm.version"),
)
RANK = {unit: rank for rank, row in enumerate(LAYERS) for unit in row}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(module: str, level: int, importer: str, is_package: bool) -> str:
    """The absolute name of ``from <level dots><module> import ...`` written in ``importer``."""
    if not level:
        return module
    base = importer.split(".")
    if not is_package:
        base.pop()
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, module] if module else base)


@cache
def _imports(name: str) -> tuple[frozenset[str], frozenset[str]]:
    """(pagedllm modules, other top-level packages) that module ``name`` imports."""
    modules = _modules()
    path = modules[name]
    inner, outer = set(), set()

    def add(target: str) -> None:
        if target.split(".")[0] != "pagedllm":
            outer.add(target.split(".")[0])
            return
        while target not in modules:  # an attribute path: the module that holds it
            target = target.rpartition(".")[0]
        inner.add(target)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node.module or "", node.level, name, path.name == "__init__.py")
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                add(sub if sub in modules else base)
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in modules
              and node.value != "pagedllm"):  # the bare name is the package's logger
            add(node.value)
    inner.discard(name)
    return frozenset(inner), frozenset(outer)


@cache
def _graph() -> nx.DiGraph:
    g = nx.DiGraph()
    for name in _modules():
        g.add_node(name)
        g.add_edges_from((name, target) for target in _imports(name)[0])
    return g


def _in(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_the_graph_sees_function_level_and_relative_imports() -> None:
    # Guards the reader itself: arrows the source is known to hold.
    g = _graph()
    assert g.has_edge("pagedllm.layers.norm", "pagedllm.kernels.rmsnorm")  # inside a function
    assert g.has_edge("pagedllm.attention", "pagedllm.attention.backend")  # a package's re-export
    assert g.has_edge("pagedllm.attention.registry", "pagedllm.attention.backends.cpu")  # named in a registry
    assert "torch" in _imports("pagedllm.kernels.launch")[1]
    assert _resolve("", 1, "pagedllm.core.scheduler", False) == "pagedllm.core"
    assert _resolve("x", 2, "pagedllm.core", True) == "pagedllm.x"


def test_no_import_cycles() -> None:
    cycles = [sorted(c) for c in nx.strongly_connected_components(_graph()) if len(c) > 1]
    described = []
    for members in sorted(cycles):
        sub = _graph().subgraph(members)
        arrows = ", ".join(f"{a} -> {b}" for a, b in sorted(sub.edges))
        described.append(f"{len(members)} modules: {arrows}")
    assert not described, "import cycles:\n" + "\n".join(described)


def _unit(module: str) -> str:
    return ".".join(module.split(".")[:2])


def test_every_unit_has_a_layer() -> None:
    assert {_unit(m) for m in _modules()} == set(RANK)


def test_arrows_point_down_the_layers() -> None:
    upward = sorted(f"{a} -> {b}" for a, b in _graph().edges
                    if _unit(a) != _unit(b) and RANK.get(_unit(a), -1) >= RANK.get(_unit(b), -1))
    assert not upward, "imports that do not point to a lower layer (see LAYERS):\n" + "\n".join(upward)


def test_core_imports_no_torch() -> None:
    g = _graph()
    core = [m for m in g if _in(m, "pagedllm.core")]
    reached = set(core).union(*(nx.descendants(g, m) for m in core))
    with_torch = sorted(m for m in reached if "torch" in _imports(m)[1])
    assert not with_torch, f"pagedllm.core reaches torch through {with_torch}"


def test_importing_core_loads_no_torch() -> None:
    # The enclosing packages' __init__ run too: pagedllm/__init__.py must not load the engine eagerly.
    core = sorted(m for m in _modules() if _in(m, "pagedllm.core"))
    code = "import sys\n" + "".join(f"import {m}\n" for m in core) + "print('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "False"


def test_kernels_import_only_kernels() -> None:
    g = _graph()
    outside = sorted(f"{a} -> {b}" for a, b in g.edges
                     if _in(a, "pagedllm.kernels") and not _in(b, "pagedllm.kernels"))
    assert not outside, "kernel modules import outside pagedllm.kernels:\n" + "\n".join(outside)
