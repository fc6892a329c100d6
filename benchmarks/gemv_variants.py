"""Times ways of widening a float8 weight inside the one-token GEMV (CUDA): which costs the read rate.

The bf16 GEMV reads Llama-3-8B's weights at 90-96% of the read ceiling, the float8 one at 56-78%, with
the same tiles. A bf16 weight widens to float32 by a shift; a float8 one through conversion
instructions. This script times the GEMV over each distinct 8B weight shape (one weight per layer,
CUDA-graph replay, as ``linear_shapes.py``) with the widening done each way:
- ``cvt``: ``w.to(float32)``, the kernel's own (``layers/kernels/gemv.py``);
- ``f16``: ``w.to(float16).to(float32)``;
- ``bits32``: the byte placed into a float32's bits by shifts and masks (the value times 2^-120), the
  activation pre-scaled by 2^64 and the sum by 2^56: every step exact, so the same bits as ``cvt``;
- ``bits16``: the byte placed into a float16's bits (the value times 2^-8), widened to float32, the
  activation pre-scaled by 2^8;
- ``bf16``: the same kernel over the weight in bf16, for comparison (its read rate over twice the bytes);
each over a few tiles, with the activation loaded once a step and shared through shared memory (``plain``,
the kernel's own), loaded as a tile of the weight's shape so that each thread reads its own columns and
no step waits at a barrier (``xtile``), or with the next weight tile loaded before the current one is used
(``prefetch``); or a [1, BLOCK_K] activation row broadcast over the tile (``xrow``), with each thread's
R neighbouring products summed before they meet the accumulator (``foldR``: R times fewer registers).
Prints µs for all layers, the read rate over the float8 bytes, and whether the output equals ``cvt``'s.
``--tokens 2,3,4`` times instead a GEMV of a few tokens (each weight tile read once for all of them)
against cuBLAS's bf16 product and the engine's float8 skinny GEMM. ``--dump-sass`` writes each variant's SASS and counts its instructions by opcode; ``--single`` launches
each named variant once, for ``ncu``.

    PYTHONPATH=$PWD python3 benchmarks/gemv_variants.py [--out DIR] [--dump-sass]
"""
from __future__ import annotations

import argparse
import collections
import itertools
import json
import os
import re

import torch
import triton
import triton.language as tl
from linear_shapes import graph_time_us as graph_us  # benchmarks/ is first on the path when run as a script

SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]
LAYERS = 32
MODES = {"cvt": 0, "f16": 1, "bits32": 2, "bits16": 3, "bf16": 0}


@triton.jit
def _widen(w, MODE: tl.constexpr):
    """A float8 tile (as uint8 in the bit modes) in float32, times 2^-120 (bits32) or 2^-8 (bits16)."""
    if MODE == 0:
        out = w.to(tl.float32)
    elif MODE == 1:
        out = w.to(tl.float16).to(tl.float32)
    elif MODE == 2:
        b = w.to(tl.uint32)
        out = (((b & 0x80) << 24) | ((b & 0x7F) << 20)).to(tl.float32, bitcast=True)
    else:
        b = w.to(tl.uint16)
        out = (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.float16, bitcast=True).to(tl.float32)
    return out


@triton.jit
def _gemv_variant(x_ptr, w_ptr, s_ptr, y_ptr, K, stride_wn, X_SCALE: tl.constexpr, Y_SCALE: tl.constexpr,
                  MODE: tl.constexpr, PREFETCH: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  X_TILE: tl.constexpr, X_ROW: tl.constexpr, FOLD: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    cols = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * stride_wn + cols[None, :]  # [BLOCK_N, BLOCK_K]
    acc = tl.zeros([BLOCK_N, BLOCK_K // FOLD], dtype=tl.float32)
    if FOLD > 1:
        # Each thread sums its own FOLD neighbouring products before adding them to its accumulator, which
        # is then FOLD times smaller: more weight bytes in flight for the same registers.
        x_ptrs = x_ptr + cols[None, :]  # [1, BLOCK_K]
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(x_ptrs + k0).to(tl.float32) * X_SCALE
            prod = _widen(tl.load(w_ptrs + k0), MODE) * x  # [BLOCK_N, BLOCK_K]
            acc += tl.sum(tl.reshape(prod, [BLOCK_N, BLOCK_K // FOLD, FOLD]), axis=2)
    elif X_ROW:
        x_ptrs = x_ptr + cols[None, :]  # [1, BLOCK_K]
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(x_ptrs + k0).to(tl.float32) * X_SCALE
            acc += _widen(tl.load(w_ptrs + k0), MODE) * x
    elif PREFETCH:
        w = tl.load(w_ptrs)
        for k0 in range(BLOCK_K, K, BLOCK_K):
            w_next = tl.load(w_ptrs + k0)
            x = tl.load(x_ptr + k0 - BLOCK_K + cols).to(tl.float32) * X_SCALE
            acc += _widen(w, MODE) * x[None, :]
            w = w_next
        x = tl.load(x_ptr + K - BLOCK_K + cols).to(tl.float32) * X_SCALE
        acc += _widen(w, MODE) * x[None, :]
    elif X_TILE:
        # The activation loaded as a [BLOCK_N, BLOCK_K] tile, each thread the columns of its own weight
        # elements (repeated rows come from L1): no exchange through shared memory, no barrier a step.
        x_ptrs = x_ptr + cols[None, :] + 0 * rows[:, None]  # [BLOCK_N, BLOCK_K]
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(x_ptrs + k0).to(tl.float32) * X_SCALE
            acc += _widen(tl.load(w_ptrs + k0), MODE) * x
    else:
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(x_ptr + k0 + cols).to(tl.float32) * X_SCALE
            acc += _widen(tl.load(w_ptrs + k0), MODE) * x[None, :]
    y = tl.sum(acc, axis=1) * Y_SCALE * tl.load(s_ptr + rows)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty))


def run_variant(x, w, s, mode: str, load: str, bn: int, bk: int, warps: int):
    """One launch: x [1, K] bf16, w [N, K] float8, s [N] float32 -> y [1, N]."""
    n, k = w.shape
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    m = MODES[mode]
    x_scale, y_scale = {0: (1.0, 1.0), 1: (1.0, 1.0), 2: (2.0 ** 64, 2.0 ** 56), 3: (256.0, 1.0)}[m]
    wv = w.view(torch.uint8) if m >= 2 else w  # a bf16 weight ("bf16") widens as the float8 one does
    return _gemv_variant[(n // bn,)](x, wv, s, y, k, w.stride(0), X_SCALE=x_scale, Y_SCALE=y_scale, MODE=m,
                                     PREFETCH=load == "prefetch", BLOCK_N=bn, BLOCK_K=bk, X_TILE=load == "xtile",
                                     X_ROW=load == "xrow", FOLD=int(load[4:]) if load.startswith("fold") else 1,
                                     num_warps=warps), y


@triton.jit
def _gemv_tokens(x_ptr, w_ptr, s_ptr, y_ptr, M, K, N, stride_xm, stride_wn, HAS_SCALE: tl.constexpr,
                 M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FOLD: tl.constexpr):
    """A few tokens at once: each weight tile read once and multiplied by every token's row, folded."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    cols = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    toks = tl.arange(0, M_PAD)  # [M_PAD]
    w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * stride_wn + cols[None, :]  # [BLOCK_N, BLOCK_K]
    x_ptrs = x_ptr + toks[:, None, None] * stride_xm + cols[None, None, :]  # [M_PAD, 1, BLOCK_K]
    x_in = toks[:, None, None] < M
    acc = tl.zeros([M_PAD, BLOCK_N, BLOCK_K // FOLD], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w = tl.load(w_ptrs + k0).to(tl.float32)  # [BLOCK_N, BLOCK_K]
        x = tl.load(x_ptrs + k0, mask=x_in, other=0.0).to(tl.float32)  # [M_PAD, 1, BLOCK_K]
        prod = w[None, :, :] * x  # [M_PAD, BLOCK_N, BLOCK_K]
        acc += tl.sum(tl.reshape(prod, [M_PAD, BLOCK_N, BLOCK_K // FOLD, FOLD]), axis=3)
    y = tl.sum(acc, axis=2)  # [M_PAD, BLOCK_N]
    if HAS_SCALE:
        y *= tl.load(s_ptr + rows)[None, :]
    tl.store(y_ptr + toks[:, None] * N + rows[None, :], y.to(y_ptr.dtype.element_ty), mask=toks[:, None] < M)


def run_tokens(x, w, s, bn: int, bk: int, warps: int, fold: int = 16):
    """x [M, K] (M <= 4), w [N, K] bf16 or float8 (s [N] its scales, or None) -> y [M, N]."""
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _gemv_tokens[(n // bn,)](x, w, s if s is not None else y, y, m, k, n, x.stride(0), w.stride(0),
                             HAS_SCALE=s is not None, M_PAD=max(2, triton.next_power_of_2(m)), BLOCK_N=bn,
                             BLOCK_K=bk, FOLD=fold, num_warps=warps)
    return y


def tokens_sweep(tokens: list[int], shapes) -> list[dict]:
    """The few-token kernel against cuBLAS (bf16) and the engine's float8 path (skinny GEMM)."""
    import torch.nn.functional as F

    from pagedllm.layers.kernels import skinny_gemm as sg

    tiles = [(2, 1024, 4), (4, 1024, 4), (2, 2048, 4), (4, 512, 4), (8, 512, 4), (4, 2048, 8), (8, 1024, 8),
             (16, 512, 8), (8, 256, 4), (2, 512, 4)]
    out = []
    for name, n, k in shapes:
        w16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05 for _ in range(LAYERS)]
        w8 = [w.to(torch.float8_e4m3fn) for w in w16]
        ss = [torch.rand(n, device="cuda") * 0.01 + 1e-3 for _ in range(LAYERS)]
        for m in tokens:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            row = {"shape": name, "tokens": m,
                   "cublas_bf16": graph_us(lambda: [F.linear(x, w) for w in w16]),
                   "skinny_fp8": graph_us(lambda: [sg.skinny_gemm(x, w, scale=s) for w, s in zip(w8, ss)])}
            ref16 = F.linear(x, w16[0]).float()
            ref8 = (x.float() @ w8[0].float().t()) * ss[0]
            for dt, ws, sc, ref in (("bf16", w16, [None] * LAYERS, ref16), ("fp8", w8, ss, ref8)):
                best = (float("inf"), None, None)
                for bn, bk, warps in tiles:
                    if n % bn or k % bk:
                        continue
                    err = (run_tokens(x, ws[0], sc[0], bn, bk, warps).float() - ref).abs().max().item()
                    us = graph_us(lambda: [run_tokens(x, w, s, bn, bk, warps) for w, s in zip(ws, sc)], reps=5)
                    best = min(best, (us, [bn, bk, warps], err))
                row[f"tokens_{dt}"], row[f"tokens_{dt}_tile"], row[f"tokens_{dt}_err"] = best
            out.append(row)
            print(f"{name:8s} T={m}: cuBLAS bf16 {row['cublas_bf16']:7.1f}  tokens-GEMV bf16 {row['tokens_bf16']:7.1f} "
                  f"{row['tokens_bf16_tile']} | skinny fp8 {row['skinny_fp8']:7.1f}  tokens-GEMV fp8 "
                  f"{row['tokens_fp8']:7.1f} {row['tokens_fp8_tile']} (err {row['tokens_bf16_err']:.2g}/"
                  f"{row['tokens_fp8_err']:.2g})", flush=True)
    return out


def sass_counts(compiled) -> dict:
    """Opcode counts of a compiled kernel's SASS (cuobjdump through triton.tools.disasm)."""
    from triton.tools.disasm import get_sass

    sass = get_sass(compiled.asm["cubin"])
    ops = collections.Counter(m.group(1).split(".")[0] for m in re.finditer(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", sass))
    return dict(ops.most_common(24)), sass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--dump-sass", action="store_true")
    ap.add_argument("--shapes", default="", help="names from qkv,o,gate_up,down (default: all)")
    ap.add_argument("--single", default="", help="MODE,...: one launch each over gate_up, for a profiler")
    ap.add_argument("--modes", default="cvt,f16", help=f"from {','.join(MODES)}")
    ap.add_argument("--loads", default="plain,xtile", help="from plain,prefetch,xtile,xrow,foldR (R: 2-16)")
    ap.add_argument("--load", default="plain", help="the load of --single")
    ap.add_argument("--tokens", default="", help="T,...: time the few-token GEMV at these token counts instead")
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = "cuda"
    if args.single:
        w = (torch.randn(28672, 4096, device=dev) * 0.05).to(torch.float8_e4m3fn)
        s, x = torch.rand(28672, device=dev), torch.randn(1, 4096, device=dev, dtype=torch.bfloat16)
        for mode in args.single.split(","):
            run_variant(x, w, s, mode, args.load, 4, 1024, 4)
        torch.cuda.synchronize()
        return
    tiles = [(4, 1024, 4), (8, 1024, 4), (8, 512, 4), (4, 2048, 4), (8, 2048, 8), (16, 1024, 8), (16, 512, 4),
             (8, 2048, 4), (16, 1024, 4), (4, 4096, 4), (2, 2048, 4), (2, 4096, 4), (4, 512, 4), (16, 2048, 4),
             (8, 4096, 4), (16, 2048, 8)]
    shapes = [s for s in SHAPES if not args.shapes or s[0] in args.shapes.split(",")]
    if args.tokens:
        rows = tokens_sweep([int(t) for t in args.tokens.split(",")], shapes)
        with open(os.path.join(args.out, "gemv_tokens.json"), "w") as f:
            json.dump(rows, f, indent=1)
        for m in sorted({r["tokens"] for r in rows}):
            sums = {key: sum(r[key] for r in rows if r["tokens"] == m)
                    for key in ("cublas_bf16", "tokens_bf16", "skinny_fp8", "tokens_fp8")}
            print(f"T={m} all shapes: " + "  ".join(f"{key} {v:.0f}" for key, v in sums.items()))
        return
    rows, sass_out = [], {}
    for name, n, k in shapes:
        ws = [(torch.randn(n, k, device=dev) * 0.05).to(torch.float8_e4m3fn) for _ in range(LAYERS)]
        ss = [torch.rand(n, device=dev) * 0.01 + 1e-3 for _ in range(LAYERS)]
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        ref = run_variant(x, ws[0], ss[0], "cvt", "plain", 4, 1024, 4)[1]
        floor_us = LAYERS * n * k / 4.54e12 * 1e6
        modes = args.modes.split(",")
        # "bf16": the same kernel over the 16-bit weights, for comparison (read rate over twice the bytes).
        ws16 = [w.to(torch.bfloat16) for w in ws] if "bf16" in modes else None
        for mode, load, (bn, bk, warps) in itertools.product(modes, args.loads.split(","), tiles):
            if n % bn or k % bk:
                continue
            wl = ws16 if mode == "bf16" else ws
            compiled, y = run_variant(x, wl[0], ss[0], mode, load, bn, bk, warps)
            same = bool(torch.equal(y, ref))
            diff = (y.float() - ref.float()).abs().max().item()
            us = graph_us(lambda: [run_variant(x, w, s, mode, load, bn, bk, warps) for w, s in zip(wl, ss)])
            rows.append({"shape": name, "mode": mode, "load": load, "tile": [bn, bk, warps], "us": us,
                         "read_frac": floor_us * (2 if mode == "bf16" else 1) / us, "same_as_cvt": same,
                         "max_diff": diff})
            if args.dump_sass and name == shapes[0][0] and (bn, bk, warps) == (4, 1024, 4):
                counts, sass = sass_counts(compiled)
                key = f"{mode}_{load}"
                sass_out[key] = counts
                with open(os.path.join(args.out, f"gemv_{key}.sass"), "w") as f:
                    f.write(sass)
        best = {}
        for r in (r for r in rows if r["shape"] == name):
            key = (r["mode"], r["load"])
            if key not in best or r["us"] < best[key]["us"]:
                best[key] = r
        print(f"{name} {n}x{k}: floor {floor_us:.1f} us at 4.54 TB/s")
        for (mode, pf), r in best.items():
            print(f"  {mode:7s} {pf:8s} best {r['us']:8.1f} us ({r['read_frac']:.2f} of read) tile {r['tile']}"
                  f" same={r['same_as_cvt']} diff={r['max_diff']:.3g}")
    with open(os.path.join(args.out, "gemv_variants.json"), "w") as f:
        json.dump({"rows": rows, "sass_counts": sass_out}, f, indent=1)
    for key, counts in sass_out.items():
        print(key, counts)


if __name__ == "__main__":
    main()
