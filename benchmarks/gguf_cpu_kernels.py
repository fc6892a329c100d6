"""Time of the CPU GGUF kernels (``pagedllm.kernels.cpu.gguf_gemm.gguf_mm``) on the default model's shapes,
against torch's float32 product with the same weight dequantized.

Workload: Gemma 3 270M Q4_K_M's linear shapes with their GGUF types (the tied LM head [262144 x 640] Q8_0;
q/gate/up/k Q5_0, v Q8_0, o and some down Q4_K, the other down Q6_K), at M rows of x. Weights are random
valid blocks (the kernels' speed does not depend on the values). Each entry is the fastest of repeated
calls (at least --min-reps, more while under --seconds), so that other load on the machine shows less.
GB/s counts the packed weight's bytes once per call; ``dense`` is ``torch.mm`` with the float32 weight;
``int8`` is the product with activations quantized to 8-bit groups (``int8_activations=True``,
``--cpu-int8-activations``; up to 16 rows, more take the float32 product).
As in a model's step, where each weight is read once, successive calls go to different copies of the
weight, enough to overflow the last-level cache (--cold-mb), so that small weights are read from memory
and not from the cache (``--cold-mb 0``: one copy, hot).

With ``--model FILE.gguf`` it times instead one decode step's products of that model: every quantized
2-D weight of the file (the embedding as the tied LM head) once, at M rows, in file order, packed weights
loaded into memory first: the kernels' share of a step, against the file's bytes.

    PYTHONPATH=$PWD python benchmarks/gguf_cpu_kernels.py [--m 1,4,16,64,512] [--threads 2] [--shapes lm_head,q]
    PYTHONPATH=$PWD python benchmarks/gguf_cpu_kernels.py --model ~/.cache/pagedllm/models/gemma-3-270m-q4_k_m.gguf --m 1,16
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import time

import torch

# name -> (ggml type, K, N)
SHAPES = {
    "lm_head": (8, 640, 262144),
    "q": (6, 640, 1024),
    "k": (6, 640, 256),
    "v": (8, 640, 256),
    "o": (12, 1024, 640),
    "gate_up": (6, 640, 2048),
    "down_q6k": (14, 2048, 640),
    "down_q4k": (12, 2048, 640),
}


def random_blocks(qtype: int, n: int, k: int) -> torch.Tensor:
    """[n, row_bytes] uint8: random bytes with every block's f16 scale fields set to small finite values."""
    from pagedllm.kernels.cpu.gguf_gemm import BLOCKS

    block, size = BLOCKS[qtype]
    w = torch.randint(0, 256, (n, k // block, size), dtype=torch.uint8)
    halves = (torch.rand(n, k // block) * 0.02 + 1e-3).half().view(torch.uint8).view(n, k // block, 2)
    for offset in {14: (208,), 12: (0, 2), 13: (0, 2)}.get(qtype, (0,)):
        w[..., offset:offset + 2] = halves
    return w.view(n, -1)


def copies(t: torch.Tensor, total_mb: float):
    """An endless cycle over enough copies of t to fill total_mb (t itself when that is one)."""
    count = max(1, math.ceil(total_mb * 1e6 / (t.numel() * t.element_size())))
    return itertools.cycle([t] + [t.clone() for _ in range(count - 1)])


def best_ms(fn, min_reps: int, seconds: float) -> float:
    fn()  # warm: first touch of the output, the built library, the thread pool
    best, start, reps = float("inf"), time.perf_counter(), 0
    while reps < min_reps or time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        reps += 1
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--m", default="1,4,16,64,512", help="rows of x, comma-separated")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--min-reps", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=0.5, help="keep repeating an entry for this long")
    parser.add_argument("--no-dense", action="store_true", help="skip the float32 torch.mm column")
    parser.add_argument("--cold-mb", type=float, default=96, help="MB of weight copies cycled through per entry")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    parser.add_argument("--model", default=None, help="a .gguf file: time one decode step's products instead")
    args = parser.parse_args()
    if args.model:
        return model_step(args)

    from pagedllm.kernels.cpu.gguf_gemm import TYPE_NAMES, available, gguf_dequantize, gguf_mm

    if args.threads:
        torch.set_num_threads(args.threads)
    if not available():
        raise SystemExit("the GGUF CPU kernels are not available here (see the log line above)")
    rows = []
    print(f"threads {torch.get_num_threads()}")
    print(f"{'shape':>16} {'type':>5} {'M':>4} {'ms':>9} {'GB/s':>6} {'int8 ms':>8} {'dense ms':>9} {'x dense':>7}")
    for name in args.shapes.split(","):
        qtype, k, n = SHAPES[name]
        w = random_blocks(qtype, n, k)
        packed = copies(w, args.cold_mb)
        dense = None if args.no_dense else copies(gguf_dequantize(w, qtype), args.cold_mb)
        for m in (int(v) for v in args.m.split(",")):
            x = torch.randn(m, k)
            ms = best_ms(lambda: gguf_mm(x, next(packed), qtype), args.min_reps, args.seconds)
            int8_ms = best_ms(lambda: gguf_mm(x, next(packed), qtype, int8_activations=True), args.min_reps,
                              args.seconds) if m <= 16 else None
            dense_ms = None if dense is None else best_ms(lambda: torch.mm(x, next(dense).t()), args.min_reps,
                                                          args.seconds)
            row = {"shape": name, "k": k, "n": n, "type": TYPE_NAMES[qtype], "m": m, "ms": round(ms, 4),
                   "gb_s": round(w.numel() / ms / 1e6, 2), "int8_ms": int8_ms and round(int8_ms, 4),
                   "dense_ms": dense_ms and round(dense_ms, 4)}
            rows.append(row)
            speedup = f"{dense_ms / ms:7.2f}" if dense_ms else f"{'-':>7}"
            dense_col = f"{dense_ms:9.3f}" if dense_ms else f"{'-':>9}"
            int8_col = f"{int8_ms:8.3f}" if int8_ms else f"{'-':>8}"
            print(f"{f'{name} {k}->{n}':>16} {row['type']:>5} {m:4d} {ms:9.3f} {row['gb_s']:6.1f} {int8_col} {dense_col} {speedup}",
                  flush=True)
        del dense
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": torch.get_num_threads(), "rows": rows}, f, indent=1)


def model_step(args: argparse.Namespace) -> None:
    """Every quantized matrix of the file once per step, at each M: the kernels' part of a decode step."""
    import numpy as np

    from pagedllm.kernels.cpu.gguf_gemm import KERNEL_TYPES, available, gguf_mm
    from pagedllm.model_loader.gguf_reader import open_gguf

    if args.threads:
        torch.set_num_threads(args.threads)
    if not available():
        raise SystemExit("the GGUF CPU kernels are not available here (see the log line above)")
    weights = []  # (qtype, K, packed [N, row_bytes])
    for t in open_gguf(args.model).tensors:
        if int(t.tensor_type) in KERNEL_TYPES and len(t.shape) == 2:
            weights.append((int(t.tensor_type), int(t.shape[0]), torch.from_numpy(np.array(t.data))))
    nbytes = sum(w.numel() for _, _, w in weights)
    print(f"threads {torch.get_num_threads()}: {len(weights)} matrices, {nbytes / 1e6:.1f} MB packed")
    for m in (int(v) for v in args.m.split(",")):
        xs = {k: torch.randn(m, k) for k in {k for _, k, _ in weights}}

        for int8 in (False, True) if m <= 16 else (False,):
            def step():
                for qtype, k, w in weights:
                    gguf_mm(xs[k], w, qtype, int8_activations=int8)

            ms = best_ms(step, args.min_reps, args.seconds)
            print(f"M={m:4d}{' int8' if int8 else ''}: {ms:8.2f} ms per step, {nbytes / ms / 1e6:5.1f} GB/s", flush=True)


if __name__ == "__main__":
    main()
