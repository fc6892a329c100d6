"""What a decode step's products cost in a chain of PDL launches: cuBLAS against the skinny GEMM and a sweep of its tiles.

In a decode step every product follows a small kernel (an RMSNorm, act·mul, the q/k norm) that, under
PDL, lets its successor launch at once. A product of our own then launches during that kernel and can
start reading its weights before its input is ready; cuBLAS's products launch only after their
predecessor has ended (``library_pdl.py``). This measures what that is worth where it counts, in a chain.

For each model, row count and product shape, every layer runs an RMSNorm of the product's input and
then the product with the layer's own weight (so L2 holds none of them), all replayed from one CUDA
graph. The chain of norms alone is timed too and subtracted: a variant's figure is what its products
add to the chain, µs a product. Every variant is checked against cuBLAS first.

    python3 benchmarks/product_chain.py [--model qwen|llama] [--rows 32,64,128,256] [--sweep | --deep | --whole-k] [--json PATH]

``--workers N`` first compiles every launch in N processes sharing Triton's cache (a sweep is ~270 tiles).
``--fp8`` times float8 weights in the skinny GEMM's default tile instead (``time_fp8``).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from linear_shapes import MODELS, graph_time_us  # noqa: E402 - a sibling script: shapes and graph timing

MODEL_NAMES = {"qwen": "qwen3-0.6b", "llama": "llama-3-8b"}


def whole_k_candidates(m: int, n: int, k: int) -> list:
    """Swapped tiles whose one step spans the program's whole input slice (512 or 1024 columns, split as
    needed), 16 or 32 weight rows, 4 or 8 warps: every weight byte of a program is requested before its
    PDL wait, so that the slice streams in while the previous kernel runs. Up to 32 token rows a tile
    (a 64-row tile spills), so up to 64 rows."""
    from pagedllm.layers.kernels import skinny_gemm as sg

    if m > 64:
        return []
    rows = min(32, max(16, 1 << (m - 1).bit_length()))
    out = []
    for bk, bn, warps in itertools.product((1024, 512), (16, 32), (4, 8)):
        if k % bk or n % bn:
            continue
        cfg = sg.GemmConfig(rows, bn, bk, warps, 1, k // bk, swap_ab=True)
        if cfg.split_k <= 8 and sg.workspace_fits(cfg, m, n):
            out.append(cfg)
    return out


def candidates(m: int, n: int, k: int, deep: bool = False) -> list:
    """Tiles whose grid is between a quarter wave and four waves of 132 SMs: plain tiles (16-128 rows by
    32-128 columns) and swapped ones (64 or 128 weight rows by the token tile), K split 1-8 ways.
    ``deep``: instead, deep pipelines (4-8 stages of 128 or 256 columns, within 220 KB of shared memory),
    so that a program has most of its weight slice in flight at once."""
    from pagedllm.layers.kernels import skinny_gemm as sg

    rows = min(256, max(16, 1 << (m - 1).bit_length()))
    out = []
    if deep:
        for swap, bn, split, bk, stages in itertools.product((False, True), (32, 64), (1, 2, 4), (128, 256), (4, 6, 8)):
            bm = min(rows, 64)
            if (swap and bn < 64) or (bm + bn) * bk * 2 * stages > 220 * 1024:
                continue
            out.append(sg.GemmConfig(bm, bn, bk, 4, stages, split, swap_ab=swap))
        return [c for c in out if -(-m // c.block_m) * (n // c.block_n) * c.split_k >= 33
                and not n % c.block_n and not k % (c.block_k * c.split_k) and sg.workspace_fits(c, m, n)]
    for bm, bn, split in itertools.product(sorted({min(rows, 64), min(rows, 128)}), (32, 64, 128), (1, 2, 4, 8)):
        bk = 128 if k // split >= 128 else 64
        out.append(sg.GemmConfig(bm, bn, bk, 8 if bm * bn >= 128 * 128 else 4, 3, split))
    for bm, bn, split in itertools.product(sorted({min(rows, 64), rows}), (64, 128), (1, 2, 4)):
        out.append(sg.GemmConfig(bm, bn, 128, 8 if bn * bm >= 128 * 128 else 4, 3, split, swap_ab=True))
    keep = []
    for cfg in out:
        programs = -(-m // cfg.block_m) * (n // cfg.block_n) * cfg.split_k
        if n % cfg.block_n or k % (cfg.block_k * cfg.split_k) or not sg.workspace_fits(cfg, m, n):
            continue
        if 33 <= programs <= 528 and cfg not in keep:
            keep.append(cfg)
    return keep


def launches(m: int, n: int, k: int, sweep: bool, deep: bool = False, whole_k: bool = False) -> list:
    """The config of every skinny-GEMM launch ``time_shape`` makes."""
    from pagedllm.layers.kernels import skinny_gemm as sg

    cfg = sg.default_config(m, n, k)
    return ([] if cfg is None else [cfg]) + sweep_configs(m, n, k, sweep, deep, whole_k)


def sweep_configs(m: int, n: int, k: int, sweep: bool, deep: bool, whole_k: bool) -> list:
    if whole_k:
        return whole_k_candidates(m, n, k)
    return candidates(m, n, k, deep) if sweep else []


def compile_shard(jobs: list, shard: int, shards: int) -> None:
    """Launch every shard-th job once, so that Triton compiles it into the shared cache."""
    from pagedllm.layers.kernels import skinny_gemm as sg

    for m, n, k, cfg in jobs[shard::shards]:
        x = torch.zeros(m, k, dtype=torch.bfloat16, device="cuda")
        w = torch.zeros(n, k, dtype=torch.bfloat16, device="cuda")
        try:
            sg.skinny_gemm(x, w, config=cfg)
        except Exception as e:
            print(f"  compile {cfg}: {type(e).__name__}", file=sys.stderr)
    torch.cuda.synchronize()


def time_fp8(m: int, n: int, k: int, layers: int) -> dict:
    """A float8 weight with row scales (``--quantization fp8``) in the skinny GEMM's default tile against
    cuBLAS on the bf16 weight; the same chain of norms."""
    from pagedllm.layers.kernels import skinny_gemm as sg
    from pagedllm.layers.kernels.rmsnorm import rms_norm
    from pagedllm.layers.quantization.fp8 import quantize_rows_ref

    torch.manual_seed(0)
    x0 = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    g = torch.ones(k, dtype=torch.bfloat16, device="cuda")
    ws = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") / k**0.5 for _ in range(layers)]
    qs = [quantize_rows_ref(w) for w in ws]
    qs = [(q, s.view(-1).contiguous()) for q, s in qs]

    def chain(product, weights):
        def run():
            for w in weights:
                product(rms_norm(x0, g, 1e-6), w)
        return run

    norms = graph_time_us(chain(lambda x, w: None, ws))
    out = {"norms_us": norms, "cublas": (graph_time_us(chain(F.linear, ws)) - norms) / layers}
    out["fp8_skinny"] = (graph_time_us(chain(lambda x, qw: sg.skinny_gemm(x, qw[0], scale=qw[1]), qs)) - norms) / layers
    return out


def time_shape(m: int, n: int, k: int, layers: int, sweep: bool, deep: bool = False, whole_k: bool = False) -> dict:
    from pagedllm.layers.kernels import skinny_gemm as sg
    from pagedllm.layers.kernels.rmsnorm import rms_norm

    torch.manual_seed(0)
    x0 = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    g = torch.ones(k, dtype=torch.bfloat16, device="cuda")
    ws = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") / k**0.5 for _ in range(layers)]
    xn = rms_norm(x0, g, 1e-6)
    ref = F.linear(xn, ws[0]).float()

    def chain(product):
        def run():
            for w in ws:
                product(rms_norm(x0, g, 1e-6), w)
        return run

    def check(product) -> None:
        err = (product(xn, ws[0]).float() - ref).abs().max().item()
        assert err <= 2e-2 * ref.abs().max().item(), err

    norms = graph_time_us(chain(lambda x, w: None))
    out = {"norms_us": norms}

    def cost(product) -> float:
        check(product)
        return (graph_time_us(chain(product)) - norms) / layers

    out["cublas"] = cost(F.linear)
    cfg = sg.default_config(m, n, k)
    if cfg is not None:
        out["skinny"] = cost(lambda x, w: sg.skinny_gemm(x, w, config=cfg))
    if sweep or whole_k:
        best = None
        for c in sweep_configs(m, n, k, sweep, deep, whole_k):
            try:
                t = cost(lambda x, w, c=c: sg.skinny_gemm(x, w, config=c))
            except Exception as e:  # a tile the compiler rejects (shared memory) is skipped, named
                print(f"  skipped {c}: {type(e).__name__}", file=sys.stderr)
                continue
            if best is None or t < best[0]:
                best = (t, c)
        if best is not None:
            t, c = best
            out["best"] = {"us": t, "config": c._asdict()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen", choices=sorted(MODEL_NAMES))
    ap.add_argument("--rows", default="32,64,128,256")
    ap.add_argument("--shapes", default="", help="qkv,o,gate_up,down (default: all)")
    ap.add_argument("--sweep", action="store_true", help="also sweep tiles (candidates())")
    ap.add_argument("--fp8", action="store_true", help="float8 weights in the default tile instead (time_fp8)")
    ap.add_argument("--deep", action="store_true", help="sweep deep pipelines instead (candidates(deep=True))")
    ap.add_argument("--whole-k", action="store_true", help="sweep one-step tiles over the whole input slice "
                    "instead (whole_k_candidates)")
    ap.add_argument("--workers", type=int, default=8, help="processes compiling the launches first (1: none)")
    ap.add_argument("--shard", type=int, default=-1, help=argparse.SUPPRESS)
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "product_chain.json"))
    args = ap.parse_args()
    layers, shapes = MODELS[MODEL_NAMES[args.model]]
    if args.shapes:
        shapes = [s for s in shapes if s[0] in args.shapes.split(",")]
    rows = [int(r) for r in args.rows.split(",")]
    jobs = [(m, n, k, c) for m in rows for _, n, k in shapes for c in launches(m, n, k, args.sweep, args.deep, args.whole_k)]
    if args.shard >= 0:
        compile_shard(jobs, args.shard, args.workers)
        return
    if args.fp8:
        for m in rows:
            for name, n, k in shapes:
                r = time_fp8(m, n, k, layers)
                print(f"{m:4d} {name:8s} " + "  ".join(f"{key} {v:6.2f}" for key, v in r.items() if key != "norms_us"),
                      flush=True)
        return
    if args.workers > 1:
        t = time.time()
        procs = [subprocess.Popen([sys.executable, *sys.argv, "--shard", str(i)]) for i in range(args.workers)]
        assert all(p.wait() == 0 for p in procs)
        print(f"compiled {len(jobs)} launches in {time.time() - t:.0f} s", flush=True)
    results = {"device": torch.cuda.get_device_name(), "model": args.model, "layers": layers, "cases": []}
    t0 = time.time()
    for m in rows:
        for name, n, k in shapes:
            r = time_shape(m, n, k, layers, args.sweep, args.deep, args.whole_k)
            r.update(rows=m, shape=name, n=n, k=k)
            results["cases"].append(r)
            best = r.get("best", {})
            print(f"{m:4d} {name:8s} cublas {r['cublas']:6.2f}  skinny {r.get('skinny', float('nan')):6.2f}  best tile "
                  f"{best.get('us', float('nan')):6.2f} {tuple(best.get('config', {}).values())}  [{time.time() - t0:.0f}s]",
                  flush=True)
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1)
    # Per layer: the four products, each variant's sum (the best tile chosen per shape).
    print("rows  cuBLAS  skinny  best tile   µs a layer (4 products)")
    for m in sorted({c["rows"] for c in results["cases"]}):
        cs = [c for c in results["cases"] if c["rows"] == m]
        def total(key):
            return sum(c[key]["us"] if isinstance(c.get(key), dict) else c.get(key, float("nan")) for c in cs)
        print(f"{m:4d} {total('cublas'):7.1f} {total('skinny'):7.1f} {total('best'):9.1f}")


if __name__ == "__main__":
    main()
