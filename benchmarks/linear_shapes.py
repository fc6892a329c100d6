"""Times the linear layers of the benchmark model shapes on CUDA: cuBLAS, cuBLASLt, the Triton GEMV, and the float8 products.

For each (model, tokens) case every distinct weight shape of the model is timed as the model runs it:
one product per layer, each layer with its own weight (so the 60 MB L2 holds none of them), all
replayed from one CUDA graph. Batch-1 rows report the weight-read rate against the device copy rate
(over the bf16 weight's bytes, so a float8 read at the same rate shows half the time); larger batches
report TFLOP/s. ``--fp8`` also times the ``quantization="fp8"`` products: the float8 GEMV at batch 1,
and above it the row quantizer plus ``torch._scaled_mm`` (``fp8``), and the two apart; at 2-64 rows also
the skinny GEMM on the float8 weight with the 16-bit activation kept (``fp8_skinny``, its default tile);
``--fp8-sweep`` sweeps its tiles up to 64 rows, the swapped ones included (``--only-swapped``: those alone;
``--light-tiles``: 16-row tiles of fewer registers and less shared memory instead).
Usage: ``python benchmarks/linear_shapes.py [--json PATH] [--fp8] [--sweep]``. (A sweep of the skinny GEMM's
tiles over 16-bit weights, which lost to cuBLAS, is in git history.)
"""
from __future__ import annotations

import argparse
import itertools
import json
import os

import torch
import torch.nn.functional as F

# (model, layers, [(name, out_features, in_features)]), from benchmarks/shapes/*/config.json.
MODELS = {
    "llama-3-8b": (32, [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]),
    "qwen3-0.6b": (28, [("qkv", 4096, 1024), ("o", 1024, 2048), ("gate_up", 6144, 1024), ("down", 1024, 3072)]),
}
HEADS = {"llama-3-8b": (128256, 4096), "qwen3-0.6b": (151936, 1024)}
CASES = [("llama-3-8b", 1), ("llama-3-8b", 16), ("llama-3-8b", 256), ("llama-3-8b", 1000), ("qwen3-0.6b", 1),
         ("qwen3-0.6b", 16), ("qwen3-0.6b", 64), ("qwen3-0.6b", 256)]


def graph_time_us(fn, reps: int = 20) -> float:
    """Median device time of one ``fn()`` replayed from a CUDA graph."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def copy_tbps() -> float:
    src = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    us = graph_time_us(lambda: dst.copy_(src))
    return 2 * src.numel() * 2 / (us * 1e-6) / 1e12


def time_tunable(x: torch.Tensor, weights: list[torch.Tensor]) -> dict:
    """TunableOp on one product shape: tuned eagerly (outside any graph), then timed from a graph.

    Also whether the tuned product equals cuBLAS's default bit for bit (a different algorithm may
    sum in another order)."""
    tunable = torch.cuda.tunable
    ref = F.linear(x, weights[0])
    tunable.enable(True)
    tunable.tuning_enable(True)
    tunable.set_max_tuning_duration(30)
    try:
        F.linear(x, weights[0])  # tunes this shape
        torch.cuda.synchronize()
        tunable.tuning_enable(False)
        t = graph_time_us(lambda: [F.linear(x, w) for w in weights])
        same = bool(torch.equal(F.linear(x, weights[0]), ref))
    finally:
        tunable.tuning_enable(False)
        tunable.enable(False)
    return {"tunable": t, "tunable_bit_equal": same}


def time_fp8(x: torch.Tensor, weights: list[torch.Tensor], sweep: bool, only_swapped: bool = False,
             light: bool = False) -> dict:
    """The float8 products of these weights (quantized per row) on these rows: the GEMV at one row, else the
    quantizer plus ``torch._scaled_mm``; with ``sweep``, the GEMV's tile configs too."""
    from pagedllm.kernels import fp8_quant
    from pagedllm.kernels.gemv import default_config, gemv
    from pagedllm.layers.quantization.fp8 import quantize_rows_ref

    quantized = [quantize_rows_ref(w) for w in weights]
    qw = [(q, s.reshape(-1), s.view(1, -1)) for q, s in quantized]
    n, k = weights[0].shape
    out = {}
    if x.shape[0] == 1 and default_config(n, k, float8=True) is not None:
        out["fp8_gemv"] = graph_time_us(lambda: [gemv(x, q, scale=s) for q, s, _ in qw])
        if sweep:
            best = (out["fp8_gemv"], str(default_config(n, k, float8=True)))
            for cfg in gemv_candidates(n, k):
                t = graph_time_us(lambda: [gemv(x, q, config=cfg, scale=s) for q, s, _ in qw], reps=5)
                best = min(best, (t, str(cfg)))
            out["fp8_best"] = best
        return out
    from pagedllm.kernels import skinny_gemm as sg
    from pagedllm.layers.quantization.fp8 import NARROW_MAX_ROWS

    # Up to 64 rows, whether or not the engine's rule (quantization/fp8.py) sends this product there.
    if x.shape[0] <= NARROW_MAX_ROWS and sg.default_config(x.shape[0], n, k) is not None:
        out["fp8_skinny"] = graph_time_us(lambda: [sg.skinny_gemm(x, q, scale=s) for q, s, _ in qw])
        if sweep:
            best = (out["fp8_skinny"], str(sg.default_config(x.shape[0], n, k)), None)
            best_swapped = (float("inf"), "", None)
            for cfg, early in fp8_skinny_candidates(x.shape[0], n, k, only_swapped, light):
                try:
                    t = graph_time_us(lambda: [sg.skinny_gemm(x, q, config=cfg, scale=s, early_launch=early)
                                               for q, s, _ in qw], reps=5)
                except Exception as exc:  # noqa: BLE001 - a tile that does not fit is skipped
                    print(f"   {cfg}: {type(exc).__name__}")
                    continue
                best = min(best, (t, str(cfg), early))
                if cfg.swap_ab:
                    best_swapped = min(best_swapped, (t, str(cfg), early))
            out["fp8_skinny_best"] = best
            out["fp8_swapped_best"] = best_swapped

    def product(q, s_row):
        xq, xs = fp8_quant.quantize_rows(x)
        return torch._scaled_mm(xq, q.t(), scale_a=xs, scale_b=s_row, out_dtype=x.dtype)

    out["fp8"] = graph_time_us(lambda: [product(q, s_row) for q, _, s_row in qw])
    out["fp8_quant"] = graph_time_us(lambda: [fp8_quant.quantize_rows(x) for _ in qw])
    xq, xs = fp8_quant.quantize_rows(x)
    out["fp8_mm_only"] = graph_time_us(
        lambda: [torch._scaled_mm(xq, q.t(), scale_a=xs, scale_b=s_row, out_dtype=x.dtype) for q, _, s_row in qw])
    return out


def time_fp8_producers(tokens: int, hidden: int, intermediate: int) -> dict:
    """The norm and the gated activation that feed float8 products: unfused (the kernel, then the row
    quantizer) against the kernel quantizing its own output, one call each per layer's worth of rows."""
    from pagedllm.kernels import activation, fp8_quant, rmsnorm

    x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device="cuda")
    w = torch.ones(hidden, dtype=torch.bfloat16, device="cuda")
    gu = torch.randn(tokens, 2 * intermediate, dtype=torch.bfloat16, device="cuda")
    return {
        "norm_then_quant": graph_time_us(lambda: fp8_quant.quantize_rows(rmsnorm.rms_norm(x, w, 1e-6, x)[0])),
        "norm_quant_fused": graph_time_us(lambda: rmsnorm.rms_norm(x, w, 1e-6, x, quantize=True)),
        "act_then_quant": graph_time_us(lambda: fp8_quant.quantize_rows(activation.act_and_mul(gu, "silu"))),
        "act_quant_fused": graph_time_us(lambda: activation.act_and_mul(gu, "silu", quantize=True)),
    }


def gemv_candidates(n: int, k: int) -> list:
    """GEMV tiles to sweep: 2-16 rows by 512-2048 columns, 4 or 8 warps."""
    from pagedllm.kernels.gemv import GemvConfig

    out = []
    for bn, bk, warps in itertools.product((2, 4, 8, 16), (512, 1024, 2048), (4, 8)):
        if n % bn or k % bk or bn * bk // (32 * warps) > 256 or (warps == 8 and bn < 8):
            continue
        out.append(GemvConfig(bn, bk, warps))
    return out


def fp8_skinny_candidates(m: int, n: int, k: int, only_swapped: bool = False, light: bool = False) -> list:
    """Skinny-GEMM launches over a float8 weight: 16-row tiles, and above 16 rows also tiles as tall as the
    rows (up to 64); 16-64 columns, 256- or 512-deep K steps, 3-4 stages, K split 1-4 ways, with the
    early launch of the next kernel up to 16 rows (which won every case of a wider sweep there). Then the
    swapped tiles (``swap_ab``): 64 or 128 weight rows a program, 128 or 256 deep. ``light``: instead,
    16-row tiles that hold fewer registers and less shared memory, for more programs an SM: 16-32
    columns, 64-256 deep, 2-3 stages, 2 or 4 warps, K split 2-8 ways."""
    from pagedllm.kernels import skinny_gemm as sg

    row_tiles = sorted({16, min(64, max(16, 1 << (m - 1).bit_length()))})
    early = m <= sg.EARLY_LAUNCH_MAX_ROWS
    out = []
    if light:
        for bn, bk, stages, warps, split in itertools.product((16, 32), (64, 128, 256), (2, 3), (2, 4), (2, 4, 8)):
            cfg = sg.GemmConfig(16, bn, bk, warps, stages, split)
            if n % bn or k % (bk * split) or not sg.workspace_fits(cfg, m, n):
                continue
            out.append((cfg, early))
        return out
    for bm, bn, bk, stages, split in itertools.product(row_tiles, (16, 32, 64), (256, 512), (3, 4), (1, 2, 4)):
        cfg = sg.GemmConfig(bm, bn, bk, 4, stages, split)
        if n % bn or k % (bk * split) or not sg.workspace_fits(cfg, m, n):
            continue
        out.append((cfg, early))
    return ([] if only_swapped else out) + [(cfg, early) for cfg in swapped_candidates(m, n, k)]


def swapped_candidates(m: int, n: int, k: int) -> list:
    """Swapped skinny-GEMM tiles: the rows' own token tile (16-64), 64 or 128 weight rows (4 or 8 warps),
    128 or 256 deep, 3-4 stages, K split 1-4 ways; up to 16 rows also 16 or 32 weight rows (1-4 warps)."""
    from pagedllm.kernels import skinny_gemm as sg

    bm = min(64, max(16, 1 << (m - 1).bit_length()))
    out = []
    for bn, warps, bk, stages, split in itertools.product((64, 128), (4, 8), (128, 256), (3, 4), (1, 2, 4)):
        cfg = sg.GemmConfig(bm, bn, bk, warps, stages, split, swap_ab=True)
        if (bn == 64 and warps == 8) or n % bn or k % (bk * split) or not sg.workspace_fits(cfg, m, n):
            continue
        out.append(cfg)
    if m <= 16:
        # 16 or 32 weight rows on the tensor cores' left side (mma.sync rather than wgmma), 1-4 warps.
        for bn, warps, bk, split in itertools.product((16, 32), (1, 2, 4), (256, 512), (1, 2, 4)):
            cfg = sg.GemmConfig(bm, bn, bk, warps, 3, split, swap_ab=True)
            if n % bn or k % (bk * split) or not sg.workspace_fits(cfg, m, n):
                continue
            out.append(cfg)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "linear_shapes.json"))
    ap.add_argument("--sweep", action="store_true",
                    help="also sweep the GEMV tile configs at batch 1 (and with --fp8 the float8 launches)")
    ap.add_argument("--hot", action="store_true",
                    help="also time cuBLAS with one weight for every layer, so it is read from L2 after the first")
    ap.add_argument("--cases", default="", help="MODEL:TOKENS,... to time instead of all cases")
    ap.add_argument("--tunable", action="store_true",
                    help="also time torch's TunableOp: each shape tuned eagerly over the BLAS algorithms, then replayed")
    ap.add_argument("--fp8", action="store_true", help="also time the float8 products of quantization='fp8'")
    ap.add_argument("--fp8-sweep", action="store_true",
                    help="with --fp8, sweep the float8 GEMV's and skinny GEMM's launches (not the 16-bit GEMV's)")
    ap.add_argument("--only-swapped", action="store_true", help="sweep only the swapped skinny tiles (swap_ab)")
    ap.add_argument("--light-tiles", action="store_true",
                    help="with --fp8-sweep, sweep float8 skinny tiles of fewer registers and less shared memory instead")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("linear_shapes: no CUDA device; nothing to time")
        return
    from pagedllm.kernels.gemv import default_config, gemv

    bw = copy_tbps()
    print(f"device copy {bw:.2f} TB/s (read + write)")
    dt = torch.bfloat16
    rows = []
    cases = CASES
    if args.cases:
        cases = [(c.split(":")[0], int(c.split(":")[1])) for c in args.cases.split(",")]
    for model, tokens in cases:
        layers, shapes = MODELS[model]
        vocab, hidden = HEADS[model]
        shapes = shapes + [("lm_head", vocab, hidden)]
        if args.fp8 and tokens > 1:
            inter = next(n for name, n, _ in shapes if name == "gate_up") // 2
            prod = time_fp8_producers(tokens, hidden, inter)
            print(f"{model:11s} T={tokens:4d} producers (us, one call): "
                  + "  ".join(f"{key} {val:.1f}" for key, val in prod.items()), flush=True)
            rows.append({"model": model, "tokens": tokens, "name": "fp8_producers", **prod})
        for name, n, k in shapes:
            count = 1 if name == "lm_head" else layers
            weights = [torch.empty(n, k, dtype=dt, device="cuda").normal_(std=0.02) for _ in range(count)]
            x = torch.randn(tokens, k, dtype=dt, device="cuda")
            nbytes = 2 * n * k * count
            flops = 2 * tokens * n * k * count
            res = {"model": model, "tokens": tokens, "name": name, "n": n, "k": k, "count": count}
            for lib in ("cublas", "cublaslt"):
                torch.backends.cuda.preferred_blas_library(lib)
                res[lib] = graph_time_us(lambda: [F.linear(x, w) for w in weights])
            torch.backends.cuda.preferred_blas_library("cublas")
            if args.tunable:
                res.update(time_tunable(x, weights))
            if args.hot:
                res["cublas_l2_hot"] = graph_time_us(lambda: [F.linear(x, weights[0]) for _ in weights])
            if tokens == 1 and default_config(n, k) is not None:
                res["gemv"] = graph_time_us(lambda: [gemv(x, w) for w in weights])
                err = (gemv(x, weights[0]).float() - F.linear(x, weights[0]).float()).abs().max().item()
                res["gemv_max_abs_diff"] = err
                if args.sweep:
                    best = (res["gemv"], str(default_config(n, k)))
                    for cfg in gemv_candidates(n, k):
                        t = graph_time_us(lambda: [gemv(x, w, config=cfg) for w in weights], reps=5)
                        best = min(best, (t, str(cfg)))
                    res["best"] = best
            if args.fp8 and name != "lm_head":
                res.update(time_fp8(x, weights, sweep=args.sweep or args.fp8_sweep, only_swapped=args.only_swapped,
                                    light=args.light_tiles))
            libs = [key for key in ("cublas", "cublaslt", "tunable", "cublas_l2_hot", "gemv", "fp8", "fp8_gemv",
                                "fp8_skinny")
                    if key in res]
            if tokens == 1:
                rate = "  ".join(f"{key} {res[key]:8.1f} us {nbytes / (res[key] * 1e-6) / 1e12 / bw:6.1%}" for key in libs)
            else:
                rate = "  ".join(f"{key} {res[key]:8.1f} us {flops / (res[key] * 1e-6) / 1e12:6.0f} TF/s" for key in libs)
            extra = f"  best {res['best'][0]:.1f} us {res['best'][1]}" if "best" in res else ""
            extra += "".join(f"  {key} {res[key]:.1f} us" for key in ("fp8_quant", "fp8_mm_only") if key in res)
            extra += f"  fp8 best {res['fp8_best'][0]:.1f} us {res['fp8_best'][1]}" if "fp8_best" in res else ""
            if "fp8_skinny_best" in res:
                extra += "  fp8 skinny best {:.1f} us {} early={}".format(*res["fp8_skinny_best"])
            if "fp8_swapped_best" in res:
                extra += "  swapped best {:.1f} us {}".format(*res["fp8_swapped_best"][:2])
            print(f"{model:11s} T={tokens:4d} {name:8s} {n:6d}x{k:5d} x{count:2d}: {rate}{extra}", flush=True)
            rows.append(res)
            weights = None
        torch.cuda.empty_cache()
    summary = {}
    for model, tokens in cases:
        sel = [r for r in rows if r["model"] == model and r["tokens"] == tokens and "cublas" in r]
        summary[f"{model} T={tokens}"] = {
            key: sum(r.get(key, r["cublas"]) for r in sel)
            for key in ("cublas", "cublaslt", "tunable", "gemv", "fp8", "fp8_gemv", "fp8_skinny")
        }
        if any("best" in r for r in sel):
            summary[f"{model} T={tokens}"]["best"] = sum(min(r["best"][0], r["cublas"]) if "best" in r else r["cublas"]
                                                         for r in sel)
    print("\nper forward pass, all linears (us; the Triton kernels fall back to cuBLAS where they do not apply):")
    for key, val in summary.items():
        print(f"  {key:20s} " + "  ".join(f"{k} {v:8.1f}" for k, v in val.items()))
    try:
        with open(args.json, "w") as f:
            json.dump({"copy_tbps": bw, "rows": rows, "summary": summary}, f, indent=1)
    except OSError:
        pass


if __name__ == "__main__":
    main()
