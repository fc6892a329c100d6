"""Whether cuBLAS's kernels wait on their predecessor, so that a CUDA graph could launch them early (PDL).

    PYTHONPATH=$PWD python3 benchmarks/library_pdl.py [--out DIR]

Our Triton kernels launch with programmatic dependent launch (pagedllm/kernel_launch.py): each starts
while its predecessor still runs and waits (``griddepcontrol.wait``) before it reads. cuBLAS's products
cannot be launched that way from Python, but a captured graph's edge into one can be made programmatic
afterwards through the driver API. That is only safe for a kernel that itself waits before reading,
which cuBLAS does not document. This script finds out, for every product shape of a Qwen3-0.6B and a
Llama-3-8B decode step at 2-256 rows (bf16), with a race: a copy kernel lets its successor launch at
once, then spins for ~2 ms before it writes the product's input; a product kernel that does not wait
reads the old (zero) input, and its output is wrong. It then times a CUDA graph of 28 layers of
[RMSNorm (Triton, PDL) -> product] pairs in Qwen3-0.6B's shapes with the captured edges and with the
products that passed linked early (device µs a replay).
"""
from __future__ import annotations

import argparse
import ctypes
import functools
import json
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pagedllm.layers.kernels.rmsnorm import rms_norm

_KERNEL_NODE = 0  # CU_GRAPH_NODE_TYPE_KERNEL
_PORT_PROGRAMMATIC = 1  # CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC: the successor may launch once every block triggered
_EDGE_PROGRAMMATIC = 1  # CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC
# Spin iterations of the race's copy kernel: a dependent float chain of 2.4 ms on an H200, far longer than
# any product of a graph-captured step (the largest, the 8B's 256-row LM head, takes ~0.4 ms).
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


# (hidden, [(N, K) of qkv, o, gate_up, down]) in bf16
SHAPES = {
    "qwen3-0.6b": [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)],
    "llama-3-8b": [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)],
}
ROWS = (2, 4, 8, 16, 32, 64, 128, 256)


def check_shapes() -> list[dict]:
    rows = []
    for model, prods in SHAPES.items():
        for n, k in prods:
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            for m in ROWS:
                x = torch.empty(m, k, device="cuda", dtype=torch.bfloat16)
                names, ok = check_waits(x, w, None)
                rows.append({"model": model, "m": m, "n": n, "k": k, "kernels": names, "waits": ok})
                print(f"{model:11s} {m:4d} x {k:5d} -> {n:5d}: {'waits' if ok else 'DOES NOT WAIT'} {names}",
                      flush=True)
    return rows


def chain(m: int, linked: bool, reps: int = 200) -> tuple[float, int, torch.Tensor]:
    """Device µs a replay of 28 x [norm -> qkv, norm -> o, norm -> gate_up, norm -> down] at ``m`` rows."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = [[torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
               for n, k in SHAPES["qwen3-0.6b"]] for _ in range(28)]
    norms = {k: torch.ones(k, device="cuda", dtype=torch.bfloat16) for _, k in SHAPES["qwen3-0.6b"]}
    x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16, generator=gen)

    def body() -> torch.Tensor:
        h = x
        for ws in layers:
            for w in ws:
                h = rms_norm(h[:, : w.shape[1]], norms[w.shape[1]], 1e-6)  # a row-strided view of the last output
                h = F.linear(h, w)
        return h

    body()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph):
        out = body()
    n_linked = 0
    if linked:
        kernels = set()
        for w in layers[0]:
            names, ok = check_waits(torch.empty(m, w.shape[1], device="cuda", dtype=torch.bfloat16), w, None)
            kernels.update(names if ok else [])
        n_linked = len(link_early(graph.raw_cuda_graph(), kernels))
    graph.instantiate()
    for _ in range(10):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps * 1000, n_linked, out.clone()


def spin_time() -> float:
    """Milliseconds the race check's copy kernel runs (its spin) on a small input."""
    src = torch.ones(1024, device="cuda")
    dst = torch.empty_like(src)
    _late_copy_kernel[(1,)](src, dst, src.numel(), _SPIN, BLOCK=1024)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    _late_copy_kernel[(1,)](src, dst, src.numel(), _SPIN, BLOCK=1024)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    print("torch", torch.__version__, "CUDA", torch.version.cuda, torch.cuda.get_device_name())
    spin_ms = spin_time()
    print(f"the check's copy kernel spins {spin_ms:.2f} ms before it writes", flush=True)
    checks = check_shapes()
    timing = []
    for m in (4, 16, 64, 256):
        plain, _, a = chain(m, linked=False)
        early, n, b = chain(m, linked=True)
        timing.append({"m": m, "captured_us": plain, "linked_us": early, "edges_linked": n,
                       "identical": bool(torch.equal(a, b))})
    print("\n| rows | captured edges, µs | products linked early, µs | ratio | edges linked | identical |")
    print("| --- | --- | --- | --- | --- | --- |")
    for t in timing:
        print(f"| {t['m']} | {t['captured_us']:.1f} | {t['linked_us']:.1f} | {t['linked_us'] / t['captured_us']:.3f} "
              f"| {t['edges_linked']} | {t['identical']} |")
    waits = sum(c["waits"] for c in checks)
    print(f"\n{waits} of {len(checks)} product shapes pick a kernel that waits")
    if args.out:
        with open(os.path.join(args.out, "library_pdl.json"), "w") as f:
            json.dump({"spin_ms": spin_ms, "checks": checks, "chain": timing}, f, indent=1)


if __name__ == "__main__":
    main()
