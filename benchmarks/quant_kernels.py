"""Microseconds per product of the W4A16/W8A16 Triton kernel (``kernels/wna16.py``) against a bfloat16
``torch.matmul`` of the dense weight, on Llama-3-8B projection shapes at M = 1, 16, 256, 4096 rows.

Prints a table (shape, M, bf16 us, wna16 us as the engine runs it, ratio, the tile kernel's, the
dequantize-then-GEMM path's and, at one row, the GEMV's (``wna16_gemv``) us) and, with ``--out DIR``, writes
the rows as JSON. ``--sweep`` also times a grid of tile configs per row (up to ``--sweep-budget-s`` seconds) and
reports the best (at one row, a grid of GEMV configs: block_n, split, warps).
``PYTHONPATH=$PWD python benchmarks/quant_kernels.py [--bits 4] [--group 128] [--m 1,16,64,256,4096] [--sweep] [--out DIR]``
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import time

import torch

from pagedllm.kernels.wna16 import DENSE_FROM_ROWS, wna16_gemv, wna16_matmul
from pagedllm.layers.quantization.unpack import pack_int32

# Llama-3-8B linears as (name, K inputs, N outputs): fused qkv, o, fused gate/up, down.
SHAPES = [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672), ("down", 14336, 4096)]


def _time_us(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / iters


def _grid(m: int):
    """(block, split, warps_stages) tile configs to try at M rows."""
    if m <= 16:
        blocks = [(16, bn, bk) for bn in (32, 64, 128) for bk in (64, 128, 256)]
        splits, ws = (1, 2, 4, 8, 16), [(4, 2), (4, 3), (4, 4)]
    else:
        blocks = [(bm, bn, bk) for bm in (32, 64, 128) for bn in (64, 128) for bk in (64, 128)]
        splits, ws = (1, 2, 4), [(4, 3), (8, 3)]
    return itertools.product(blocks, splits, ws)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bits", type=int, default=4, choices=(4, 8))
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--m", default="1,16,64,256,4096")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--sweep", action="store_true", help="also time a grid of tile configs per row")
    ap.add_argument("--sweep-budget-s", type=float, default=150.0)
    ap.add_argument("--out", default=None, help="a folder (quant_kernels.json is written there) or a file")
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    deadline = time.monotonic() + args.sweep_budget_s
    print(f"{'shape':>8} {'K':>6} {'N':>6} {'M':>5} {'bf16 us':>8} {'wna16':>8} {'ratio':>6} {'tile':>8} {'dense':>8} {'gemv':>8}"
          f"{'  best tile (us, block, split, warps/stages)' if args.sweep else ''}")
    for name, k, n in SHAPES:
        q = torch.randint(0, 1 << args.bits, (k, n), device=dev)
        qw = pack_int32(q, args.bits, 0).contiguous()
        del q
        s = (torch.rand(k // args.group, n, device=dev) * 0.01).to(torch.bfloat16)
        z = torch.full(s.shape, float(1 << (args.bits - 1)), device=dev)
        dense = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
        for m in (int(v) for v in args.m.split(",")):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ref = _time_us(lambda: torch.matmul(x, dense.t()), args.iters)
            got = _time_us(lambda: wna16_matmul(x, qw, s, z, args.bits, args.group), args.iters)
            tile = _time_us(lambda: wna16_matmul(x, qw, s, z, args.bits, args.group, dense_from_rows=1 << 30,
                                                 gemv=False), args.iters)
            deq = _time_us(lambda: wna16_matmul(x, qw, s, z, args.bits, args.group, dense_from_rows=1), args.iters)
            gemv = (_time_us(lambda: wna16_gemv(x, qw, s, z, args.bits, args.group), args.iters) if m == 1
                    else float("nan"))  # the one-row kernel without tensor cores
            row = {"shape": name, "k": k, "n": n, "m": m, "bits": args.bits, "group": args.group,
                   "bf16_us": ref, "wna16_us": got, "ratio": got / ref, "tile_us": tile, "dense_us": deq,
                   "gemv_us": gemv, "dense_from_rows": DENSE_FROM_ROWS}
            best = None
            if args.sweep and m == 1:
                for bn, split, warps in itertools.product((32, 64, 128, 256), (None, 1, 2, 4, 8), (2, 4, 8)):
                    if time.monotonic() > deadline:
                        break
                    t = _time_us(lambda: wna16_gemv(x, qw, s, z, args.bits, args.group, block_n=bn, split_k=split,
                                                    num_warps=warps), 10)
                    if best is None or t < best[0]:
                        best = (t, bn, split, warps)
                row["best_gemv"] = best
            elif args.sweep and m <= 256:
                for block, split, ws in _grid(m):
                    if time.monotonic() > deadline:
                        break
                    try:
                        t = _time_us(lambda: wna16_matmul(x, qw, s, z, args.bits, args.group, split_k=split,
                                                          block=block, warps_stages=ws, dense_from_rows=1 << 30),
                                     10)
                    except Exception:  # noqa: BLE001 - configs beyond the device's resources are skipped
                        continue
                    if best is None or t < best[0]:
                        best = (t, block, split, ws)
                row["best_tile"] = best
            rows.append(row)
            extra = f"  {best[0]:.1f} {best[1]} {best[2]} {best[3]}" if best else ""
            print(f"{name:>8} {k:>6} {n:>6} {m:>5} {ref:>8.1f} {got:>8.1f} {got / ref:>6.2f} {tile:>8.1f} {deq:>8.1f} {gemv:>8.1f}"
                  f"{extra}", flush=True)
    if args.out:
        path = os.path.join(args.out, "quant_kernels.json") if os.path.isdir(args.out) else args.out
        with open(path, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(dev), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
