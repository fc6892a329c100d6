"""Instructions in the main loop of the W4A16 and W8A8 kernels, compiled for sm_90 on any machine (no GPU needed).

The host wrappers run on small CPU tensors while each kernel's launch is recorded instead of run; every recorded
launch is compiled for compute capability 9.0 with Triton's bundled ptxas (``tests/hopper_compile.py``'s recorder
and compiler) and disassembled (``cuobjdump``). For
each launch it prints the SASS instructions of the longest loop (the walk along K), that count per weight of one
thread's share of a step, and the most frequent opcodes: the one-row GEMV (float32 and pairs kernels) at several
``BLOCK_N``, and the tiles at the engine's configs for 16, 32, 128 and 256 rows with each dequantization
(two-step float32, ``_scaled_tile``'s fused multiply-add, ``_pairs_tile``); and the W8A8 decode kernel over one
row at its default tiles for gate_up and down, quantizing the row in every program or reading the int8 row its
producer stored (``kernels/row_quant.py``). ``other loops``: the instructions of a launch's other loops (for the
W8A8 kernel, the pass over the row for its largest magnitude).

    python benchmarks/kernel_sass.py [--out DIR]
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "tests"))

# Tile rows -> the tile config the engine picks for Llama-3-8B's gate_up at that many rows (BLOCK_M, BLOCK_N,
# BLOCK_K, warps, stages, W x^T), as ``kernels/wna16.py``'s _config does on an H100 / H200.
TILES = {16: (16, 64, 128, 4, 3, False), 32: (32, 64, 64, 4, 3, False), 128: (128, 128, 64, 8, 3, True),
         256: (256, 128, 64, 8, 4, True)}


def _sass(kernel, args, kwargs) -> str:
    """SASS of one recorded launch, compiled for sm_90 as Triton specializes it at launch."""
    from hopper_compile import _compiled
    from triton.tools.disasm import get_sass

    return get_sass(_compiled(kernel, args, kwargs, specialize=True).asm["cubin"])


def loops(sass: str) -> list[list[str]]:
    """The opcodes of each backward branch's body (a loop), in the order of the code."""
    lines = sass.splitlines()
    labels = {line.strip()[:-1]: i for i, line in enumerate(lines) if re.fullmatch(r"\s*\S+:", line)}
    found = []
    for i, line in enumerate(lines):
        m = re.search(r"BRA (\S+);", line)
        if m and labels.get(m.group(1), i) < i:
            ops = [re.search(r"\t(?:@!?P\w+\s+)?([A-Z][A-Z0-9_]*)", x) for x in lines[labels[m.group(1)] + 1:i + 1]]
            found.append([o.group(1) for o in ops if o])
    return found


def main_loop(sass: str) -> list[str]:
    """The opcodes of the longest loop's body."""
    return max(loops(sass), key=len, default=[])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT"), help="also write the rows as JSON into DIR")
    args = ap.parse_args()
    os.environ.pop("TRITON_INTERPRET", None)
    from hopper_compile import _record

    from pagedllm.kernels import int8_gemm, int8_quant, wna16, wna16_gemv
    from pagedllm.kernels.row_quant import QuantizedRows
    import pagedllm.kernels.numerics as km

    km._compiled_for_nvidia = lambda t: True  # the explicitly rounded arithmetic compiled NVIDIA code runs

    wna16_gemv.pairs_apply = wna16.pairs_apply = lambda x, bits: bits == 4 and x.dtype != torch.float32
    launches: list = []
    for kernel in (wna16_gemv._wna16_gemv_kernel, wna16_gemv._wna16_gemv_pairs_kernel, wna16._wna16_kernel,
                   int8_gemm._w8a8_kernel):
        _record(kernel, launches)
    _record(int8_quant._quant_rows_kernel, [])  # the producer's row is made, not compiled
    k, n, group = 4096, 28672, 128
    qw = torch.zeros(k // 8, n, dtype=torch.int32)
    s, z = torch.zeros(k // group, n, dtype=torch.bfloat16), torch.zeros(k // group, n)
    names, weights = [], []  # a thread's weights a step
    for bn in (64, 128, 256):
        for pairs in (False, True):
            wna16_gemv.wna16_gemv(torch.zeros(1, k, dtype=torch.bfloat16), qw, s, z, 4, group, block_n=bn,
                                  split_k=1, pairs=pairs)
            names.append(f"GEMV BLOCK_N {bn}, {'pairs' if pairs else 'float32'}")
            weights.append(128 * bn // 128)
    for rows, (bm, bn, bk, warps, stages, swap) in TILES.items():
        for mode in ("two-step", "fma", "pairs"):
            wna16.wna16_matmul(torch.zeros(rows, k, dtype=torch.bfloat16), qw, s, z, 4, group, block=(bm, bn, bk),
                               warps_stages=(warps, stages), swap_ab=swap, split_k=1, dense_from_rows=1 << 30,
                               gemv=False, fma_dequant=mode == "fma", pairs_dequant=mode == "pairs")
            names.append(f"tiles {rows} rows ({bm}x{bn}x{bk}, {warps} warps), {mode}")
            weights.append(bk * bn // (32 * warps))
    for name, n, k in (("gate_up", 28672, 4096), ("down", 4096, 14336)):
        for rows in (False, True):
            x = torch.zeros(1, k, dtype=torch.bfloat16)
            given = QuantizedRows(*int8_quant.quantize_rows(x), x.dtype) if rows else x
            int8_gemm.w8a8_decode(given, torch.zeros(n, k, dtype=torch.int8), torch.ones(n))
            cfg = int8_gemm.default_config(1, n, k)
            names.append(f"W8A8 one row, {name} (BLOCK_N {cfg.block_n}, BLOCK_K {cfg.block_k}), "
                         f"{'producer row' if rows else 'quantized in each program'}")
            weights.append(cfg.block_n * cfg.block_k // (32 * cfg.num_warps))
    rows_out = []
    for (kernel, kargs, kwargs), name, per_thread in zip(launches, names, weights):
        sass = _sass(kernel, kargs, kwargs)
        ops = main_loop(sass)
        other = sum(len(loop) for loop in loops(sass)) - len(ops)
        top = collections.Counter(ops).most_common(6)
        rows_out.append({"launch": name, "loop": len(ops), "per_weight": len(ops) / per_thread, "other_loops": other,
                         "top": top})
        print(f"{name:68s} {len(ops):5d} a step  {len(ops) / per_thread:5.2f} a weight  other loops {other:4d}  "
              + " ".join(f"{op} {c}" for op, c in top), flush=True)
    if args.out:
        with open(os.path.join(args.out, "kernel_sass.json"), "w") as f:
            json.dump(rows_out, f, indent=1)


if __name__ == "__main__":
    main()
