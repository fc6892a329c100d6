"""Whether a persistent Triton GEMM ``y = x @ W^T`` beats cuBLAS on Llama-3-8B's decode-batch products.

At 128-512 rows cuBLAS leaves an H200 at 460-635 of ~785 TFLOP/s, mostly to wave quantization: a
few dozen to a few hundred output tiles over 132 SMs. Here one program per SM walks the tiles, and
the input dimension can be split over ``split_k`` programs per tile (summed in the same launch by the
last to arrive), so that the work divides into whole waves. Every candidate is checked against cuBLAS,
then timed from a CUDA graph cycling through distinct weights (so L2 does not hold W).

    python3 benchmarks/persistent_gemm.py [--model llama|qwen] [--rows 128,256,512] [--shapes qkv,o,gate_up,down,lm_head] [--json PATH]
    python3 benchmarks/persistent_gemm.py --check   # correctness on tiny shapes; runs on a CPU (interpreter)

``--configs N`` caps the Triton configs timed per product (default 40, half of them the TMA twins).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import NamedTuple

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from linear_shapes import graph_time_us  # noqa: E402 - a sibling script: the same graph timing

MODEL_SHAPES = {  # [N, K] of each product
    "llama": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
              "lm_head": (128256, 4096)},
    "qwen": {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072),
             "lm_head": (151936, 1024)},
}
SHAPES = MODEL_SHAPES["llama"]
L2_SPAN_BYTES = 160 * 2**20  # distinct weights cycled per timing: over 3x the H200's 50 MB L2
SMEM_BYTES = 220 * 1024  # below the H200's 227 KB per block: the epilogue needs some too


class Config(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1
    tma: bool = False
    per_sm: int = 1  # resident programs per SM, when their pipeline buffers fit twice

    def label(self) -> str:
        return (f"{self.block_m}x{self.block_n}x{self.block_k} w{self.num_warps} s{self.num_stages} "
                f"split{self.split_k}{' tma' if self.tma else ''}{' 2/sm' if self.per_sm > 1 else ''}")


@triton.jit
def _persistent_gemm_kernel(
    x,  # [M, K] pointer, or a [BLOCK_M, BLOCK_K] TMA descriptor when USE_TMA
    w,  # [N, K] pointer, or a [BLOCK_N, BLOCK_K] TMA descriptor when USE_TMA
    y_ptr,  # [M, N]
    part_ptr,  # [SPLIT_K, M, N] float32 partials (only when SPLIT_K > 1)
    count_ptr,  # [tiles] int32 arrivals per output tile, zero on entry and on exit
    M, N, K, stride_xm, stride_wn, stride_ym,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    SUM_M: tl.constexpr,  # rows of the tile summed at a time when SPLIT_K > 1
    USE_TMA: tl.constexpr,
):
    tiles_m = tl.cdiv(M, BLOCK_M)
    units = tiles_m * tl.cdiv(N, BLOCK_N) * SPLIT_K
    k_len = K // SPLIT_K  # a multiple of BLOCK_K (host checks)
    # Unit order: row tile fastest, then split, then column tile. Programs that run together hold
    # consecutive units, so they read the same W slice (once from DRAM) for every row tile.
    for unit in range(tl.program_id(0), units, tl.num_programs(0)):
        tm = unit % tiles_m
        split = (unit // tiles_m) % SPLIT_K
        tn = unit // (tiles_m * SPLIT_K)
        rows = tm * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tn * BLOCK_N + tl.arange(0, BLOCK_N)
        k_start = split * k_len
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if USE_TMA:
            # Out-of-range rows and columns arrive as zeros, padded by the copy engine.
            for k0 in range(k_start, k_start + k_len, BLOCK_K):
                a = x.load([tm * BLOCK_M, k0])
                b = w.load([tn * BLOCK_N, k0])
                acc = tl.dot(a, b.T, acc)
        else:
            ks = k_start + tl.arange(0, BLOCK_K)
            x_ptrs = x + rows.to(tl.int64)[:, None] * stride_xm + ks[None, :]  # [BLOCK_M, BLOCK_K]
            w_ptrs = w + cols.to(tl.int64)[:, None] * stride_wn + ks[None, :]  # [BLOCK_N, BLOCK_K]
            for k0 in range(0, k_len, BLOCK_K):
                a = tl.load(x_ptrs + k0, mask=(rows < M)[:, None], other=0.0)
                b = tl.load(w_ptrs + k0, mask=(cols < N)[:, None], other=0.0)
                acc = tl.dot(a, b.T, acc)
        mask = (rows < M)[:, None] & (cols < N)[None, :]
        if SPLIT_K == 1:
            tl.store(y_ptr + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
                     mask=mask)
        else:
            part = part_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :]  # split 0's [BLOCK_M, BLOCK_N]
            plane = M.to(tl.int64) * N
            tl.store(part + split * plane, acc, mask=mask)
            # All threads' partials are stored before the count is raised (release); the program that
            # raises it last reads the other partials only after it (acquire), bypassing L1.
            tl.debug_barrier()
            tile = tn * tiles_m + tm
            arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT_K - 1:
                tl.debug_barrier()
                # A whole fp32 tile per split at once would spill next to the pipeline's registers.
                for r0 in tl.static_range(0, BLOCK_M, SUM_M):
                    r = tm * BLOCK_M + r0 + tl.arange(0, SUM_M)
                    rmask = (r < M)[:, None] & (cols < N)[None, :]
                    rpart = part_ptr + r.to(tl.int64)[:, None] * N + cols[None, :]  # [SUM_M, BLOCK_N]
                    total = tl.zeros([SUM_M, BLOCK_N], dtype=tl.float32)
                    for s in tl.static_range(SPLIT_K):  # fixed order: same bits whoever arrives last
                        total += tl.load(rpart + s * plane, mask=rmask, other=0.0, cache_modifier=".cg")
                    tl.store(y_ptr + r.to(tl.int64)[:, None] * stride_ym + cols[None, :],
                             total.to(y_ptr.dtype.element_ty), mask=rmask)
                tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")


# Per device: float32 partials and tile counters shared by all split launches on one stream, grown
# on demand (outside graph capture: every caller runs once eagerly first).
_workspaces: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _workspace(device: torch.device, floats: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    parts, counts = _workspaces.get(device, (None, None))
    if parts is None or parts.numel() < floats:
        parts = torch.empty(floats, dtype=torch.float32, device=device)
    if counts is None or counts.numel() < tiles:
        counts = torch.zeros(tiles, dtype=torch.int32, device=device)
    _workspaces[device] = (parts, counts)
    return parts, counts


def num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def persistent_gemm(
    x: torch.Tensor,  # [M, K]
    w: torch.Tensor,  # [N, K]
    cfg: Config,
    num_programs: int | None = None,
) -> torch.Tensor:  # [M, N]
    m, k = x.shape
    n = w.shape[0]
    assert k % (cfg.block_k * cfg.split_k) == 0 and x.stride(1) == 1 and w.stride(1) == 1, (m, n, k, cfg)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    grid = num_programs or min(tiles * cfg.split_k, num_sms(x.device) * cfg.per_sm)
    parts, counts = _workspace(x.device, cfg.split_k * m * n, tiles) if cfg.split_k > 1 else (y, y)
    if cfg.tma:
        xa = TensorDescriptor.from_tensor(x, [cfg.block_m, cfg.block_k])
        wa = TensorDescriptor.from_tensor(w, [cfg.block_n, cfg.block_k])
    else:
        xa, wa = x, w
    _persistent_gemm_kernel[(grid,)](
        xa, wa, y, parts, counts, m, n, k, x.stride(0), w.stride(0), y.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k,
        SUM_M=min(cfg.block_m, 1024 * cfg.num_warps // cfg.block_n), USE_TMA=cfg.tma,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return y


def check() -> bool:
    """Tiny shapes against a float32 product; split launches must leave zero counters and be reproducible."""
    torch.manual_seed(0)
    # One warp makes the split sums run over several row chunks (SUM_M < BLOCK_M).
    families = [Config(32, 32, 32, 4, 2), Config(16, 64, 32, 4, 2, split_k=2), Config(64, 32, 32, 1, 2, split_k=4),
                Config(32, 32, 64, 4, 2, tma=True), Config(16, 32, 32, 4, 2, split_k=2, tma=True),
                Config(32, 64, 32, 1, 2, split_k=4, tma=True)]
    cases = [(m, n, k, torch.float16) for m in (5, 64, 70) for n, k in ((64, 128), (96, 256))]
    cases += [(70, 96, 128, torch.float32)]
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda" and torch.cuda.get_device_capability(dev)[0] < 9:
        families = [c for c in families if not c.tma]
    ok = True
    for cfg in families:
        for m, n, k, dtype in cases:
            x = torch.randn(m, k, device=dev).to(dtype)  # [M, K]
            w = (torch.randn(n, k, device=dev) * k**-0.5).to(dtype)  # [N, K]
            ref = x.float() @ w.float().T  # [M, N]
            # Three programs, so every program walks several units (and split partners land on different programs).
            y = persistent_gemm(x, w, cfg, num_programs=3)
            diff = (y.float() - ref).abs()
            err = diff.max().item()
            # fp16: rounding of the output (half an ulp) plus accumulation; a GPU multiplies fp32 as tf32.
            atol = 4e-3 if dtype == torch.float16 or dev.type == "cpu" else 2e-2
            good = bool((diff <= atol + 5e-4 * ref.abs()).all())
            note = ""
            if cfg.split_k > 1:
                parts, counts = _workspaces[x.device]
                zero = bool((counts == 0).all())
                parts.fill_(float("nan"))
                again = persistent_gemm(x, w, cfg, num_programs=3)
                same = torch.equal(y.view(torch.int16 if dtype == torch.float16 else torch.int32),
                                   again.view(torch.int16 if dtype == torch.float16 else torch.int32))
                zero = zero and bool((counts == 0).all())
                good = good and zero and same
                note = f" counters_zero={zero} same_bits_after_nan={same}"
            ok = ok and good
            print(f"{'ok  ' if good else 'FAIL'} {cfg.label():34s} M={m:3d} N={n:3d} K={k:3d} {str(dtype)[6:]:8s} "
                  f"max_err={err:.2e}{note}", flush=True)
    return ok


def candidates(rows: int, n: int, k: int, sms: int, tma: bool, limit: int) -> list[Config]:
    """The sweep for one product, pruned by shared memory and ranked by a rough model of the time.

    Time ~ waves of units x work per unit / tile efficiency, where a tile's operand reuse
    (bm*bn / (bm+bn)) sets how close it gets to tensor-core peak. TMA doubles every kept tile shape.
    """
    scored = []
    for bm in (64, 128):
        for bn in (64, 128, 256):
            for bk in (64, 128):
                for stages in (3, 4):
                    smem = stages * (bm + bn) * bk * 2
                    if bm > rows or smem > SMEM_BYTES:
                        continue
                    tiles = triton.cdiv(rows, bm) * triton.cdiv(n, bn)
                    per_sm = 2 if 2 * smem <= SMEM_BYTES else 1
                    warps = 8 if bm * bn >= 128 * 256 else 4
                    reuse = bm * bn / (bm + bn)
                    for split in (1, 2, 4, 8):
                        # Splitting only pays where the tiles fill fewer than about two waves.
                        if k % (split * bk) or (split > 1 and tiles >= 2 * sms):
                            continue
                        units = tiles * split
                        slots = min(units, sms * per_sm)
                        est = math.ceil(units / slots) * per_sm * bm * bn * (k // split) / (reuse / (reuse + 24))
                        est *= 1 + 0.05 * (split - 1) + 0.01 * (4 - stages)
                        scored.append((est, Config(bm, bn, bk, warps, stages, split, False, per_sm)))
    scored.sort(key=lambda e: e[0])
    keep = [c for _, c in scored[: limit // 2 if tma else limit]]
    return keep + [c._replace(tma=True) for c in keep] if tma else keep


def bench(rows_list: list[int], shape_names: list[str], limit: int, shapes: dict) -> list[dict]:
    dev = torch.device("cuda")
    sms = num_sms(dev)
    tma = torch.cuda.get_device_capability(dev)[0] >= 9
    t0 = time.time()
    results = []
    for rows in rows_list:
        for name in shape_names:
            n, k = shapes[name]
            flop = 2 * rows * n * k
            torch.manual_seed(0)
            x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)  # [rows, K]
            copies = max(4, math.ceil(L2_SPAN_BYTES / (n * k * 2)))
            weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]  # [N, K]
            ref = F.linear(x, weights[0]).float()
            cublas = graph_time_us(lambda: [F.linear(x, w) for w in weights]) / len(weights)
            res = {"rows": rows, "shape": name, "n": n, "k": k, "cublas_us": cublas,
                   "cublas_tflops": flop / cublas / 1e6, "configs": []}
            print(f"[{time.time() - t0:5.0f}s] rows={rows} {name} ({n}x{k}): cuBLAS {cublas:.1f} us "
                  f"{res['cublas_tflops']:.0f} TFLOP/s", flush=True)
            for cfg in candidates(rows, n, k, sms, tma, limit):
                entry = {"config": cfg._asdict(), "label": cfg.label()}
                res["configs"].append(entry)
                try:
                    err = (persistent_gemm(x, weights[0], cfg).float() - ref).abs()
                    torch.cuda.synchronize()
                except Exception as e:  # shared memory overflow and other compile failures
                    entry["error"] = type(e).__name__
                    print(f"    skip {cfg.label()}: {type(e).__name__}", flush=True)
                    continue
                # Two bf16 roundings of the same sum can differ by an ulp, which is 0.06 above 8.
                if not bool((err <= 0.05 + 2**-6 * ref.abs()).all()):
                    entry["error"] = f"wrong: max abs diff {err.max().item():.3g}"
                    print(f"    SKIP WRONG {cfg.label()}: max abs diff {err.max().item():.3g}", flush=True)
                    continue
                try:
                    us = graph_time_us(lambda: [persistent_gemm(x, w, cfg) for w in weights]) / len(weights)
                except Exception as e:
                    entry["error"] = f"timing: {type(e).__name__}"
                    print(f"    skip {cfg.label()} (timing): {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                entry.update(us=us, tflops=flop / us / 1e6)
                print(f"    {cfg.label():40s} {us:8.1f} us {entry['tflops']:5.0f} TFLOP/s "
                      f"x{cublas / us:.2f}", flush=True)
            timed = [c for c in res["configs"] if "us" in c]
            res["best"] = min(timed, key=lambda c: c["us"]) if timed else None
            results.append(res)
            weights.clear()  # frees the copies before the next shape allocates its own
            torch.cuda.empty_cache()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="correctness on tiny shapes only (CPU interpreter ok)")
    ap.add_argument("--rows", default="128,256,512")
    ap.add_argument("--model", default="llama", choices=sorted(MODEL_SHAPES))
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--configs", type=int, default=40, help="most Triton configs timed per product")
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "persistent_gemm.json"))
    args = ap.parse_args()
    if args.check:
        sys.exit(0 if check() else 1)
    if not torch.cuda.is_available():
        sys.exit("timing needs CUDA; use --check for correctness on a CPU")
    results = bench([int(r) for r in args.rows.split(",")], args.shapes.split(","), args.configs,
                    MODEL_SHAPES[args.model])
    print(f"\n{'rows':>4} {'shape':8} {'cuBLAS us':>9} {'TFLOP/s':>7}  {'best Triton config':40} {'us':>8} "
          f"{'TFLOP/s':>7} {'cuBLAS/best':>11}")
    for r in results:
        b = r["best"]
        best = (f"{b['label']:40} {b['us']:8.1f} {b['tflops']:7.0f} {r['cublas_us'] / b['us']:11.2f}" if b
                else f"{'(none ran)':40}")
        print(f"{r['rows']:4d} {r['shape']:8} {r['cublas_us']:9.1f} {r['cublas_tflops']:7.0f}  {best}")
    try:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": triton.__version__, "results": results}, f, indent=1)
        print(f"wrote {args.json}")
    except OSError as e:
        print(f"could not write {args.json}: {e}")


if __name__ == "__main__":
    main()
