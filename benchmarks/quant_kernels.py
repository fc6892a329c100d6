"""Microseconds per product of the W4A16/W8A16 Triton kernel (``kernels/wna16.py``) against a bfloat16
``torch.matmul`` of the dense weight, on Llama-3-8B projection shapes at M = 1, 16, 256, 4096 rows.

Prints a table (shape, M, bf16 us, wna16 us, ratio) and, with ``--out F``, writes the rows as JSON.
``PYTHONPATH=$PWD python benchmarks/quant_kernels.py [--bits 4] [--group 128] [--m 1,16,256,4096] [--out F]``
"""
from __future__ import annotations

import argparse
import json

import torch

from pagedllm.kernels.wna16 import wna16_matmul
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bits", type=int, default=4, choices=(4, 8))
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--m", default="1,16,256,4096")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    print(f"{'shape':>8} {'K':>6} {'N':>6} {'M':>5} {'bf16 us':>9} {'wna16 us':>9} {'ratio':>6}")
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
            rows.append({"shape": name, "k": k, "n": n, "m": m, "bits": args.bits, "group": args.group,
                         "bf16_us": ref, "wna16_us": got, "ratio": got / ref})
            print(f"{name:>8} {k:>6} {n:>6} {m:>5} {ref:>9.1f} {got:>9.1f} {got / ref:>6.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(dev), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
