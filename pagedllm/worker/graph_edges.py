"""Programmatic (PDL) edges into cuBLAS's kernels inside captured CUDA graphs, for kernels shown to wait.

Our Triton kernels launch with programmatic dependent launch (kernel_launch.py): each is launched while
its predecessor still runs and waits (``griddepcontrol.wait``) before reading. cuBLAS's products cannot
be launched that way from Python, so in a decode step every product starts only after its predecessor
has finished, and pays its full launch latency. After a graph is captured, an edge into a product can
be turned into a programmatic one through the driver API. That is safe only when the product's kernel
itself waits before reading, which cuBLAS does not document per kernel. So each distinct product shape
recorded during the capture (layers/library_calls.py) is checked first, on the device: a copy kernel
that lets its successor launch at once, then spins for longer than any product runs before it writes
the product's input. A kernel that does not wait reads the old input, and its output is wrong. Only
kernels that pass (and never fail) are linked early; every other edge stays as captured.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pagedllm.kernel_launch import PDL_MAX_TOKENS, device_is_hopper_or_later

logger = logging.getLogger("pagedllm")

_KERNEL_NODE = 0  # CU_GRAPH_NODE_TYPE_KERNEL
_PORT_PROGRAMMATIC = 1  # CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC: the successor may launch once every block triggered
_EDGE_PROGRAMMATIC = 1  # CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC
# Spin iterations of the check's copy kernel: a dependent float chain of ~1 ms, far longer than any
# product of a graph-captured step (the largest, a 256-row LM head, takes ~0.1 ms on an H200).
_SPIN = 400_000


class _EdgeData(ctypes.Structure):  # CUgraphEdgeData
    _fields_ = [("from_port", ctypes.c_ubyte), ("to_port", ctypes.c_ubyte), ("type", ctypes.c_ubyte),
                ("reserved", ctypes.c_ubyte * 5)]


class _KernelParams(ctypes.Structure):  # CUDA_KERNEL_NODE_PARAMS_v2
    _fields_ = [("func", ctypes.c_void_p), ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared_mem", ctypes.c_uint), ("kernel_params", ctypes.c_void_p), ("extra", ctypes.c_void_p),
                ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


@functools.cache
def _driver() -> ctypes.CDLL | None:
    """libcuda with the graph-edge entry points (driver API 12.3 and later), or None."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        for name in ("cuGraphGetEdges_v2", "cuGraphAddDependencies_v2", "cuGraphRemoveDependencies_v2",
                     "cuGraphNodeGetType", "cuGraphKernelNodeGetParams_v2", "cuFuncGetName", "cuKernelGetName"):
            getattr(lib, name).restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    return lib


def _check(code: int, what: str) -> None:
    if code != 0:
        raise RuntimeError(f"{what} failed with CUresult {code}")


def _edges(graph: int) -> list[tuple[int, int, tuple[int, int, int]]]:
    """(from node, to node, (from port, to port, type)) of every edge of a cudaGraph_t."""
    lib, g, n = _driver(), ctypes.c_void_p(graph), ctypes.c_size_t(0)
    _check(lib.cuGraphGetEdges_v2(g, None, None, None, ctypes.byref(n)), "cuGraphGetEdges_v2")
    src, dst, data = (ctypes.c_void_p * n.value)(), (ctypes.c_void_p * n.value)(), (_EdgeData * n.value)()
    _check(lib.cuGraphGetEdges_v2(g, src, dst, data, ctypes.byref(n)), "cuGraphGetEdges_v2")
    return [(src[i], dst[i], (data[i].from_port, data[i].to_port, data[i].type)) for i in range(n.value)]


def _kernel_name(node: int, names: dict[int, str | None]) -> str | None:
    """The function name of a kernel node; None for other nodes (memsets, copies, events)."""
    if node not in names:
        lib, kind = _driver(), ctypes.c_int(-1)
        _check(lib.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind)), "cuGraphNodeGetType")
        name = None
        if kind.value == _KERNEL_NODE:
            params, text = _KernelParams(), ctypes.c_char_p()
            _check(lib.cuGraphKernelNodeGetParams_v2(ctypes.c_void_p(node), ctypes.byref(params)),
                   "cuGraphKernelNodeGetParams_v2")
            if params.func:
                code = lib.cuFuncGetName(ctypes.byref(text), ctypes.c_void_p(params.func))
            else:
                code = lib.cuKernelGetName(ctypes.byref(text), ctypes.c_void_p(params.kern))
            name = text.value.decode() if code == 0 and text.value else None
        names[node] = name
    return names[node]


def link_early(graph: int, kernels: set[str], sources: set[str] | None = None) -> list[str]:
    """Turns every default edge from a kernel node into a kernel named in ``kernels`` programmatic (with
    ``sources``, only edges from kernels named there). Returns the linked targets' names."""
    lib, names, todo = _driver(), {}, []
    for src, dst, data in _edges(graph):  # every lookup first: a failed one leaves the graph untouched
        if data != (0, 0, 0):
            continue  # already programmatic (a PDL launch), or a port we do not touch
        src_name, dst_name = _kernel_name(src, names), _kernel_name(dst, names)
        if src_name is not None and dst_name in kernels and (sources is None or src_name in sources):
            todo.append((src, dst, dst_name))
    g = ctypes.c_void_p(graph)
    for src, dst, _ in todo:
        frm, to = (ctypes.c_void_p * 1)(src), (ctypes.c_void_p * 1)(dst)
        edge = (_EdgeData * 1)()
        edge[0].from_port, edge[0].type = _PORT_PROGRAMMATIC, _EDGE_PROGRAMMATIC
        _check(lib.cuGraphRemoveDependencies_v2(g, frm, to, None, ctypes.c_size_t(1)), "cuGraphRemoveDependencies_v2")
        code = lib.cuGraphAddDependencies_v2(g, frm, to, edge, ctypes.c_size_t(1))
        if code != 0:  # put the plain edge back: the graph must never lose an ordering
            _check(lib.cuGraphAddDependencies_v2(g, frm, to, None, ctypes.c_size_t(1)), "cuGraphAddDependencies_v2")
            _check(code, "cuGraphAddDependencies_v2 (programmatic)")
    return [name for _, _, name in todo]


@triton.jit
def _late_copy_kernel(src_ptr, dst_ptr, n, spin, BLOCK: tl.constexpr):
    """Lets its successor launch at once, spins, and only then copies ``src`` into ``dst``."""
    tl.extra.cuda.gdc_wait()
    tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], tl.float32) + pid.to(tl.float32)
    for _ in range(spin):
        acc = acc * 0.999 + 1.0  # converges to 1000 from above 0: never negative
    for start in range(pid * BLOCK, n, tl.num_programs(0) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        v = tl.load(src_ptr + offs, mask=mask, other=0.0)
        # The copy depends on the spin, so no reordering can store before it ends.
        v = tl.where(acc < 0.0, 0.0, v.to(tl.float32))
        tl.store(dst_ptr + offs, v.to(dst_ptr.dtype.element_ty), mask=mask)


def race(consume, src: torch.Tensor, spin: int = _SPIN) -> tuple[list[str], float]:
    """Captures [late copy of ``src`` into a zeroed buffer] -> ``consume(buffer)``, links the consumer's
    kernels early and replays once. Returns (the linked kernels' names, the largest absolute difference
    of the replayed output from ``consume(src)`` run serialized)."""
    dst = torch.zeros_like(src)
    expected = consume(src).float()
    grid = (min(triton.cdiv(src.numel(), 1024), 64),)  # all programs resident at once: all trigger at once
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph):
        _late_copy_kernel[grid](src, dst, src.numel(), spin, BLOCK=1024, launch_pdl=True)
        out = consume(dst)
    linked = link_early(graph.raw_cuda_graph(), _AnyKernel(), sources={_late_copy_kernel.fn.__name__})
    graph.instantiate()
    dst.zero_()
    graph.replay()
    torch.cuda.synchronize()
    err = (out.float() - expected).abs().max().item()
    del graph
    return linked, err


def check_waits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[list[str], bool]:
    """Whether the kernels cuBLAS picks for ``F.linear`` over an input shaped like ``x`` [T, K] wait on their
    predecessor: (their names, True when the early-linked product still saw its input)."""
    src = torch.empty(x.shape, dtype=x.dtype, device=x.device).uniform_(-1.0, 1.0)  # [T, K]
    linked, err = race(lambda inp: F.linear(inp, weight, bias), src)
    scale = F.linear(src, weight, bias).float().abs().max().item()
    # A kernel that read the zeroed buffer returns the bias alone: off by the output's own size.
    return linked, bool(linked) and err <= 0.05 * max(scale, 1e-3)


class _AnyKernel:
    """A set holding every kernel name (the check links whatever follows its copy kernel)."""

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str)


class LibraryLinker:
    """Checks the library products recorded during captures and links the kernels that wait early."""

    def __init__(self) -> None:
        self._checked: dict[tuple, tuple[list[str], bool]] = {}
        self.waits: set[str] = set()
        self.never: set[str] = set()  # kernels seen reading before their predecessor finished

    def check(self, calls: dict) -> None:
        """Race-checks each recorded call (layers/library_calls.py) whose shape key is new."""
        new = 0
        for key, (x, weight, bias) in calls.items():
            if key in self._checked or not x.is_contiguous():
                continue
            names, ok = check_waits(x, weight, bias)
            self._checked[key] = (names, ok)
            (self.waits if ok else self.never).update(names)
            new += 1
            if not ok and names:
                logger.info("cuBLAS kernel(s) %s read before their predecessor finished: left unlinked", names)
        if new:
            # The checks' buffers (up to a 256-row LM head's logits) go back to the device, so that they
            # are not counted as graph memory nor held beside the KV cache.
            torch.cuda.empty_cache()

    def link(self, graph: torch.cuda.CUDAGraph) -> int:
        return len(link_early(graph.raw_cuda_graph(), self.waits - self.never))


@functools.cache
def shared_linker() -> LibraryLinker:
    """One per process: the decode and the mixed-batch graphs share product shapes, checked once."""
    return LibraryLinker()


def enabled(device: torch.device, size: int) -> bool:
    """Whether a graph of ``size`` tokens gets its library products linked early: PDL is on for launches of
    that size (kernel_launch.py), torch can edit a graph before instantiating it, and the driver can too."""
    if os.environ.get("PAGEDLLM_LIBRARY_PDL", "1") == "0" or os.environ.get("PAGEDLLM_PDL", "1") == "0":
        return False
    if device.type != "cuda" or size > PDL_MAX_TOKENS or os.environ.get("TRITON_INTERPRET", "0") == "1":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return device_is_hopper_or_later(index) and _driver() is not None and _keeps_graph()


@functools.cache
def _keeps_graph() -> bool:
    try:
        torch.cuda.CUDAGraph(keep_graph=True)
    except (TypeError, RuntimeError):
        return False
    return hasattr(torch.cuda.CUDAGraph, "instantiate")
