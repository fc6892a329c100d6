"""Microseconds per product of the W4A16/W8A16 Triton kernel (``kernels/wna16.py``) against a bfloat16
``torch.matmul`` of the dense weight, on Llama-3-8B projection shapes at M = 1, 16, 256, 4096 rows.

Prints a table (shape, M, bf16 us, wna16 us as the engine runs it, ratio, the tile kernel's, the
same tiles dequantizing in float32 (``pairs_dequant=False``), the dequantize-then-GEMM path's and, at one row, the GEMV's (``wna16_gemv``, then its float32 kernel) us) and, with ``--out DIR``, writes
the rows as JSON. ``--sweep`` also times a grid of tile configs per row (up to ``--sweep-budget-s`` seconds over all shapes) and
reports the best (at one row, a grid of GEMV configs: block_n, split, warps).
``--dequant`` times the many-row path's dequantization alone (``wna16_dequantize``) over a grid of its tiles, with the
bytes it moves a second; ``--int8`` times the W8A8 linear instead (``int8_rows``); ``--fp8-block`` the block-wise float8 linear
(``kernels/fp8_block.py``, 128x128 weight blocks, activations quantized per token and 128 inputs; ``fp8_block_rows``).
``PYTHONPATH=$PWD python benchmarks/quant_kernels.py [--bits 4] [--group 128] [--m 1,16,64,256,4096] [--sweep] [--dequant | --int8 | --fp8-block] [--out DIR]``
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import time

import torch

from pagedllm.kernels.wna16 import DENSE_FROM_ROWS, DEQUANT_TILE, wna16_dequantize, wna16_gemv, wna16_matmul
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
    """(block, split, warps_stages, swap_ab) tile configs to try at M rows, likeliest first (a sweep stops at its
    deadline)."""
    if m <= 16:
        blocks = [(16, bn, bk) for bn in (32, 64, 128) for bk in (64, 128, 256)]
        splits, ws, swaps = (1, 2, 4, 8, 16), [(4, 2), (4, 3), (4, 4)], (False,)
    elif m <= 64:
        blocks = [(bm, bn, bk) for bm in (32, 64) for bn in (64, 128) for bk in (64, 128)]
        splits, ws, swaps = (1, 2, 4), [(4, 3), (8, 3)], (False, True)
    else:
        # Many rows: large tiles, so that each unpacked weight feeds many rows' products.
        blocks = [(128, 128, 64), (256, 128, 64), (128, 256, 64), (128, 128, 128), (64, 128, 64), (64, 256, 64)]
        splits, ws, swaps = (1, 2), [(8, 3), (4, 3), (8, 4)], (True, False)
    return ((b, sp, w, sw) for sw in swaps for b in blocks for sp in splits for w in ws)


def _int8_tile_grid(m: int):
    """W8A8 tile configs (block_m, block_n, block_k, warps, stages, split_k) to try at M > 16 rows, likeliest first
    (a sweep stops at its deadline). Triton keeps an int32 accumulator's tensor-core product synchronous, and the
    activation tiles are read again for every column tile, so the large tiles come first, split along K where
    they would leave SMs idle."""
    from pagedllm.kernels.int8_gemm import TileConfig

    bms = [bm for bm in (256, 128, 64) if bm <= 2 * max(m, 32)]
    for bm in bms:
        warps = 8 if bm == 256 else 4
        for split in (1, 2, 4, 8):
            yield TileConfig(bm, 128, 128, warps, 3, split)
            yield TileConfig(bm, 128, 64, warps, 4, split)
    for bm in bms:
        for split in (1, 2, 4):
            yield TileConfig(bm, 64, 128, 4, 4, split)
            yield TileConfig(bm, 256, 64, 8, 3, split)


def int8_rows(args, dev: torch.device, deadline: float) -> list[dict]:
    """``--int8``: the W8A8 linear at each row count: the one-launch decode kernel (up to 16 rows), its two-launch
    form (rows quantized first), the tiles of more rows (``w8a8_tiles``), the product from rows a norm or activation
    kernel already quantized (``rows``: decode kernel or tiles, as the engine runs them since the producers store
    int8 rows), the cuBLAS path (row quantizer, cuBLAS int8 product padded to 32 rows, epilogue) and each of its
    three parts. The decode sweep also tries producer rows with K split over 1, 2 or 4 programs a tile."""
    from pagedllm.kernels import int8_quant
    from pagedllm.kernels.int8_gemm import MAX_ROWS, TileConfig, w8a8_decode, w8a8_tiles
    from pagedllm.kernels.row_quant import QuantizedRows
    from pagedllm.layers.quantization.int8 import _int_mm

    rows = []
    print(f"{'shape':>8} {'K':>6} {'N':>6} {'M':>5} {'bf16 us':>8} {'decode':>8} {'prequant':>8} {'tiles':>8} {'rows':>8} {'ratio':>6}"
          f" {'path':>8} {'quant':>8} {'int_mm':>8} {'epilog':>8}")
    for name, k, n in SHAPES:
        w = torch.randint(-128, 128, (n, k), device=dev, dtype=torch.int8)
        ws = torch.rand(n, 1, device=dev) * 1e-3
        dense = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
        for m in (int(v) for v in args.m.split(",")):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            xq, xs = int8_quant.quantize_rows(x)
            acc = _int_mm(xq, w)
            ref = _time_us(lambda: torch.matmul(x, dense.t()), args.iters)
            dec = _time_us(lambda: w8a8_decode(x, w, ws, None), args.iters) if m <= MAX_ROWS else float("nan")
            pre = (_time_us(lambda: w8a8_decode(x, w, ws, None, prequantize=True), args.iters) if m <= MAX_ROWS
                   else float("nan"))
            tiles = _time_us(lambda: w8a8_tiles(x, w, ws, None), args.iters) if m > MAX_ROWS else float("nan")
            given = QuantizedRows(xq, xs, x.dtype)
            product = w8a8_decode if m <= MAX_ROWS else w8a8_tiles
            from_rows = _time_us(lambda: product(given, w, ws, None), args.iters)
            path = _time_us(lambda: int8_quant.scale_rows(_int_mm(int8_quant.quantize_rows(x)[0], w), xs, ws, None,
                                                          x.dtype), args.iters)
            quant = _time_us(lambda: int8_quant.quantize_rows(x), args.iters)
            mm = _time_us(lambda: _int_mm(xq, w), args.iters)
            epi = _time_us(lambda: int8_quant.scale_rows(acc, xs, ws, None, x.dtype), args.iters)
            best = min(dec, pre, path) if m <= MAX_ROWS else min(tiles, path)
            tuned = None
            if args.sweep and m <= MAX_ROWS:
                # mode: the row quantized in every program, in a launch before, or by its producer (K split n ways)
                modes = ("in-kernel", "prequantize", "rows/1", "rows/2", "rows/4")
                for bn, bk, warps, mode in itertools.product((16, 32, 64), (128, 256, 512), (4, 8), modes):
                    if time.monotonic() > deadline:
                        break
                    tile = dict(block_n=bn, block_k=bk, num_warps=warps)
                    if mode.startswith("rows"):
                        t = _time_us(lambda: w8a8_decode(given, w, ws, None, split_k=int(mode[5:]), **tile), 10)
                    else:
                        t = _time_us(lambda: w8a8_decode(x, w, ws, None, prequantize=mode == "prequantize", **tile), 10)
                    if tuned is None or t < tuned[0]:
                        tuned = (t, bn, bk, warps, mode)
                print(f"   best decode tile (us, block_n, block_k, warps, rows quantized): {tuned}", flush=True)
            elif args.sweep:
                shape_deadline = min(deadline, time.monotonic() + args.sweep_budget_s / len(SHAPES))
                for cfg in _int8_tile_grid(m):
                    if time.monotonic() > shape_deadline:
                        break
                    try:
                        t = _time_us(lambda: w8a8_tiles(x, w, ws, None, config=cfg), 10)
                    except Exception:  # noqa: BLE001 - tiles beyond the device's resources are skipped
                        continue
                    if tuned is None or t < tuned[0]:
                        tuned = (t, *cfg)
                print(f"   best tile (us, block_m, block_n, block_k, warps, stages, split_k): {tuned}", flush=True)
            rows.append({"shape": name, "k": k, "n": n, "m": m, "bf16_us": ref, "decode_us": dec,
                         "prequantized_us": pre, "tiles_us": tiles, "rows_us": from_rows, "path_us": path, "best_decode_tile": tuned,
                         "ratio": best / ref, "quant_us": quant, "int_mm_us": mm, "epilogue_us": epi})
            print(f"{name:>8} {k:>6} {n:>6} {m:>5} {ref:>8.1f} {dec:>8.1f} {pre:>8.1f} {tiles:>8.1f} {from_rows:>8.1f} {best / ref:>6.2f}"
                  f" {path:>8.1f} {quant:>8.1f} {mm:>8.1f} {epi:>8.1f}", flush=True)
    return rows


def dequant_rows(args, dev: torch.device) -> list[dict]:
    """µs and GB/s of ``wna16_dequantize`` per shape: the default tile, then each tile of a small grid."""
    tiles = [DEQUANT_TILE] + [(bk, bn, w) for bk in (64, 128) for bn in (128, 256, 512) for w in (4, 8)
                              if (bk, bn, w) != DEQUANT_TILE]
    rows = []
    print(f"{'shape':>8} {'K':>6} {'N':>6} {'default us':>10} {'GB/s':>7}  best (us, GB/s, tile)")
    for name, k, n in SHAPES:
        qw = torch.randint(-2**31, 2**31 - 1, (k * args.bits // 32, n), device=dev, dtype=torch.int32)
        s = (torch.rand(k // args.group, n, device=dev) * 0.01).to(torch.bfloat16)
        z = torch.full(s.shape, float(1 << (args.bits - 1)), device=dev)
        moved = qw.nbytes + s.nbytes + z.nbytes + k * n * 2
        times = {}
        for tile in tiles:
            times[tile] = _time_us(lambda: wna16_dequantize(qw, s, z, args.bits, args.group, None, torch.bfloat16,
                                                            tile=tile), args.iters)
        best = min(times, key=times.get)
        t0, tb = times[DEQUANT_TILE], times[best]
        rows.append({"shape": name, "k": k, "n": n, "bits": args.bits, "group": args.group, "bytes": moved,
                     "default_tile": list(DEQUANT_TILE), "default_us": t0,
                     "tiles": [[list(t), us] for t, us in times.items()]})
        print(f"{name:>8} {k:>6} {n:>6} {t0:>10.1f} {moved / t0 / 1e3:>7.0f}  {tb:.1f} {moved / tb / 1e3:.0f} {best}",
              flush=True)
    return rows


def fp8_block_rows(args, dev: torch.device) -> list[dict]:
    """bf16 cuBLAS against the block-wise float8 product (quantizing the activations included), µs per call: the
    path the engine takes (``fp8blk``: cuBLAS's block-scaled GEMM from ``CUBLAS_MIN_ROWS`` where it is there) and
    the Triton kernel at every size (``triton``)."""
    from pagedllm.kernels import fp8_block

    def triton_only(x, w, scale):
        cut, fp8_block.CUBLAS_MIN_ROWS = fp8_block.CUBLAS_MIN_ROWS, 1 << 62
        try:
            return fp8_block.fp8_block_linear(x, w, scale, (128, 128), 128)
        finally:
            fp8_block.CUBLAS_MIN_ROWS = cut

    rows = []
    print(f"{'shape':>8} {'K':>6} {'N':>6} {'M':>5} {'bf16 us':>8} {'fp8blk':>8} {'ratio':>6} {'triton':>8}")
    for name, k, n in SHAPES:
        dense = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
        w = (dense.float() * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        scale = torch.rand(n // 128, k // 128, device=dev) * 1e-2
        for m in (int(v) for v in args.m.split(",")):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ref = _time_us(lambda: torch.matmul(x, dense.t()), args.iters)
            got = _time_us(lambda: fp8_block.fp8_block_linear(x, w, scale, (128, 128), 128), args.iters)
            tri = _time_us(lambda: triton_only(x, w, scale), args.iters)
            rows.append({"shape": name, "k": k, "n": n, "m": m, "bf16_us": ref, "fp8_block_us": got,
                         "ratio": got / ref, "triton_us": tri})
            print(f"{name:>8} {k:>6} {n:>6} {m:>5} {ref:>8.1f} {got:>8.1f} {got / ref:>6.2f} {tri:>8.1f}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bits", type=int, default=4, choices=(4, 8))
    ap.add_argument("--int8", action="store_true", help="time the W8A8 int8 linear instead")
    ap.add_argument("--dequant", action="store_true", help="time the many-row path's dequantization alone")
    ap.add_argument("--fp8-block", action="store_true", help="time the block-wise float8 linear instead")
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--m", default="1,16,64,256,4096")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--sweep", action="store_true", help="also time a grid of tile configs per row")
    ap.add_argument("--sweep-budget-s", type=float, default=150.0)
    ap.add_argument("--out", default=None, help="a folder (quant_kernels.json is written there) or a file")
    args = ap.parse_args()
    dev = torch.device("cuda")
    if args.fp8_block:
        return _write(args.out, dev, "fp8_block_rows", fp8_block_rows(args, dev))
    if args.dequant:
        return _write(args.out, dev, "dequant_rows", dequant_rows(args, dev))
    if args.int8:
        return _write(args.out, dev, "int8_rows", int8_rows(args, dev, time.monotonic() + args.sweep_budget_s))
    rows = []
    print(f"{'shape':>8} {'K':>6} {'N':>6} {'M':>5} {'bf16 us':>8} {'wna16':>8} {'ratio':>6} {'tile':>8} {'tile32':>7} {'dense':>8} {'gemv':>8} {'f32':>7}"
          f"{'  best tile (us, block, split, warps/stages)' if args.sweep else ''}")
    for name, k, n in SHAPES:
        deadline = time.monotonic() + args.sweep_budget_s / len(SHAPES)  # each shape its share of the sweep
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
            tile_f32 = _time_us(lambda: wna16_matmul(x, qw, s, z, args.bits, args.group, dense_from_rows=1 << 30,
                                                     gemv=False, pairs_dequant=False), args.iters)
            deq = _time_us(lambda: wna16_matmul(x, qw, s, z, args.bits, args.group, dense_from_rows=1), args.iters)
            gemv = (_time_us(lambda: wna16_gemv(x, qw, s, z, args.bits, args.group), args.iters) if m == 1
                    else float("nan"))  # the one-row kernel without tensor cores
            gemv_f32 = (_time_us(lambda: wna16_gemv(x, qw, s, z, args.bits, args.group, pairs=False), args.iters)
                        if m == 1 else float("nan"))  # its float32 kernel, where the default is the pairs one
            row = {"shape": name, "k": k, "n": n, "m": m, "bits": args.bits, "group": args.group,
                   "bf16_us": ref, "wna16_us": got, "ratio": got / ref, "tile_us": tile, "tile_f32_dequant_us": tile_f32, "dense_us": deq,
                   "gemv_us": gemv, "gemv_f32_us": gemv_f32, "dense_from_rows": DENSE_FROM_ROWS}
            best = None
            if args.sweep and m == 1:
                # The split first at the default tile, then the tile and warps at the best split.
                first = [dict(split_k=sp) for sp in (None, 4, 8, 16, 32)]
                for kw in first + [None] + [dict(block_n=bn, num_warps=w) for bn in (64, 128, 256) for w in (4, 8)]:
                    if time.monotonic() > deadline:
                        break
                    if kw is None:
                        base = dict(best[1])
                        continue
                    kw = {**base, **kw} if "block_n" in kw else kw
                    t = _time_us(lambda: wna16_gemv(x, qw, s, z, args.bits, args.group, **kw), 10)
                    if best is None or t < best[0]:
                        best = (t, kw)
                row["best_gemv"] = best
            elif args.sweep and m <= 4096:
                for block, split, ws, swap in _grid(m):
                    if time.monotonic() > deadline:
                        break
                    try:
                        t = _time_us(lambda: wna16_matmul(x, qw, s, z, args.bits, args.group, split_k=split,
                                                          block=block, warps_stages=ws, dense_from_rows=1 << 30,
                                                          swap_ab=swap), 10)
                    except Exception:  # noqa: BLE001 - configs beyond the device's resources are skipped
                        continue
                    if best is None or t < best[0]:
                        best = (t, block, split, ws, swap)
                row["best_tile"] = best
            rows.append(row)
            if best and m == 1:
                extra = f"  {best[0]:.1f} {best[1]}"
            else:
                extra = f"  {best[0]:.1f} {best[1]} {best[2]} {best[3]}{' swap' if best[4] else ''}" if best else ""
            print(f"{name:>8} {k:>6} {n:>6} {m:>5} {ref:>8.1f} {got:>8.1f} {got / ref:>6.2f} {tile:>8.1f} {tile_f32:>7.1f} {deq:>8.1f} {gemv:>8.1f} {gemv_f32:>7.1f}{extra}", flush=True)
    _write(args.out, dev, "rows", rows)


def _write(out: str | None, dev: torch.device, key: str, rows: list[dict]) -> None:
    """The rows as JSON under ``key`` in ``out`` (a folder, where quant_kernels.json is written, or a file)."""
    if out:
        path = os.path.join(out, "quant_kernels.json") if os.path.isdir(out) else out
        with open(path, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(dev), key: rows}, f, indent=1)


if __name__ == "__main__":
    main()
