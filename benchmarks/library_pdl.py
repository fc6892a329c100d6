"""Which cuBLAS kernels wait on their predecessor, and what launching them early saves (worker/graph_edges.py).

    PYTHONPATH=$PWD python3 benchmarks/library_pdl.py [--out DIR]

(1) For every product shape of a Qwen3-0.6B and a Llama-3-8B decode step at 2-256 rows (bf16), the race
check of graph_edges.py: the kernel cuBLAS picks and whether it saw an input written ~1 ms after it was
allowed to launch. (2) A CUDA graph of 28 layers of [RMSNorm (Triton, PDL) -> product] pairs in Qwen3-0.6B's
shapes, replayed with the captured edges and with the products linked early: device µs a replay.
"""
from __future__ import annotations

import argparse
import json
import os

import torch

from pagedllm.layers.kernels.rmsnorm import rms_norm
from pagedllm.worker import graph_edges

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
                names, ok = graph_edges.check_waits(x, w, None)
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
                h = torch.nn.functional.linear(h, w)
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
            names, ok = graph_edges.check_waits(torch.empty(m, w.shape[1], device="cuda", dtype=torch.bfloat16), w, None)
            kernels.update(names if ok else [])
        n_linked = len(graph_edges.link_early(graph.raw_cuda_graph(), kernels))
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
    graph_edges._late_copy_kernel[(1,)](src, dst, src.numel(), graph_edges._SPIN, BLOCK=1024)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph_edges._late_copy_kernel[(1,)](src, dst, src.numel(), graph_edges._SPIN, BLOCK=1024)
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
