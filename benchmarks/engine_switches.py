"""A/B of the engine's opt-in GPU switches on the issue's workloads, each variant in a fresh process.

    PYTHONPATH=$PWD python3 benchmarks/engine_switches.py --out $OUT [--variants base,nopdl,gemm,qknorm,all]

Variants set environment switches over the defaults (``base``): ``nopdl`` is PAGEDLLM_PDL=0 (no
programmatic dependent launch, which is on by default on sm90), ``gemm`` is PAGEDLLM_TRITON_GEMM=1 (the skinny GEMM for 2-256-token products), and ``qknorm`` turns on
the Qwen3 q/k RMSNorm inside the decode attention kernel (``TritonImpl.fuse_decode_qk_norm``), and ``noorder`` has
decode attention take requests in batch order instead of longest context first (``TritonImpl.use_decode_order``), and
``pagedrows`` has prompt attention read the step's own keys through the block table (``TritonImpl.chunk_kv_from_step``),
and ``perhead`` serves prompt chunks one query head a program (``TritonImpl.prompt_per_head``), and ``fp8kv`` keeps
the KV cache in float8 e4m3 (``kv_cache_dtype="fp8"``, an engine option rather than a switch). ``fp8nopieces``, ``fp8pieces512`` and
``fp8pieces792`` keep it too, with float8 decode in one program per (request, KV head), in 512-key pieces, or in
pieces only from 792 such pairs (``TritonImpl.decode_pieces``, ``decode_piece_len``, ``decode_pieces_min_programs``).
``fp8w`` quantizes the weights to float8 at load (``quantization="fp8"``), ``fp8all`` does so over a float8 cache, and
``fp8wgemm`` sends its 2-64-row float8 products through the skinny GEMM (with every other product of
2-256 rows), and ``fp8wnoskinny`` quantizes the tokens of 2-64-row float8 products for ``torch._scaled_mm``
instead (PAGEDLLM_FP8_SKINNY=0; ``fp8wskinny`` names the default). ``unfolded`` and ``fp8wunfolded`` give the
one-token GEMV an element-wise accumulator and its earlier tiles (``_unfolded_gemv_config``). ``attnwrite``
has the attention launch store Qwen3's new keys and values, not its q/k norm + rotary launch
(``TritonImpl.kv_written_by_caller``). ``latewait`` has decode attention wait on its predecessor before
reading its request's length and first tile (``TritonImpl.decode_early_loads``). ``buckets8`` captures decode
graphs every 8 requests, as vLLM does, through ``compilation_config``. ``nogcfreeze`` leaves the engine's start-up objects in the garbage
collector's full collections (PAGEDLLM_GC_FREEZE=0, ``engine/heap.py``). Each variant runs
(1) workload 3, Llama-3-8B batch 1, 1000-token prompt, time per output token, and (2) workload 1,
Qwen3-0.6B 256 prompts in/out U[100, 1024], output tok/s; with ``--workload2`` also (3) workload 2, with
``--batches 2,4,...`` the 8B's time per output token at those batch sizes, and with ``--no-workload1`` not
(2). Random weights, bf16, greedy. Prints a table of the figures per variant and their ratio to ``base``;
writes one JSON file.
``--smoke`` runs the same code with a tiny model on the CPU (switches are then inert).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
QWEN = os.path.join(HERE, "shapes", "qwen3-0.6b")
LLAMA = os.path.join(HERE, "shapes", "llama-3-8b")
VARIANTS = {
    "base": {},
    "nopdl": {"PAGEDLLM_PDL": "0"},
    "gemm": {"PAGEDLLM_TRITON_GEMM": "1"},
    # Not an environment switch of the engine: this script's child turns on TritonImpl.fuse_decode_qk_norm.
    "qknorm": {"BENCH_FUSE_DECODE_QK_NORM": "1"},
    "all": {"PAGEDLLM_TRITON_GEMM": "1", "BENCH_FUSE_DECODE_QK_NORM": "1"},
    # This script's child turns off TritonImpl.use_decode_order (decode programs in batch order).
    "noorder": {"BENCH_NO_DECODE_ORDER": "1"},
    # This script's child turns off TritonImpl.chunk_kv_from_step (prompt tiles read through the block table).
    "pagedrows": {"BENCH_PAGED_CHUNK_KEYS": "1"},
    # This script's child turns on TritonImpl.prompt_per_head (prompt chunks one query head a program).
    "perhead": {"BENCH_PROMPT_PER_HEAD": "1"},
    # This script's child builds its engines with kv_cache_dtype="fp8".
    "fp8kv": {"BENCH_KV_CACHE_DTYPE": "fp8"},
    # ... and has attention take its products in float16 there (TritonImpl.float8_fp16_dots).
    "fp8kvf16": {"BENCH_KV_CACHE_DTYPE": "fp8", "BENCH_FP8_FP16_DOTS": "1"},
    # This script's child sets TritonImpl.decode_pieces (float8 decode contexts cut into even pieces, on by
    # default): off, on with 512-key pieces, or on from 6 (request, KV head) pairs an SM of an H200 only.
    "fp8nopieces": {"BENCH_KV_CACHE_DTYPE": "fp8", "BENCH_DECODE_PIECES": "0"},
    "fp8pieces512": {"BENCH_KV_CACHE_DTYPE": "fp8", "BENCH_DECODE_PIECES": "512"},
    "fp8pieces792": {"BENCH_KV_CACHE_DTYPE": "fp8", "BENCH_DECODE_PIECES": "1", "BENCH_DECODE_PIECES_MIN": "792"},
    # This script's child builds its engines with quantization="fp8" (float8 weights), alone or with the float8 cache.
    "fp8w": {"BENCH_QUANTIZATION": "fp8"},
    "fp8all": {"BENCH_QUANTIZATION": "fp8", "BENCH_KV_CACHE_DTYPE": "fp8"},
    # ... and float8 products of 2-64 rows (by the rule of quantization/fp8.py) through the skinny GEMM,
    # which reads the float8 weight directly.
    "fp8wgemm": {"BENCH_QUANTIZATION": "fp8", "PAGEDLLM_TRITON_GEMM": "1"},
    "fp8wskinny": {"BENCH_QUANTIZATION": "fp8", "PAGEDLLM_FP8_SKINNY": "1"},
    "fp8wnoskinny": {"BENCH_QUANTIZATION": "fp8", "PAGEDLLM_FP8_SKINNY": "0"},
    # This script's child gives the one-token GEMV its tiles from before folded products (_unfolded_gemv_config).
    "attnwrite": {"BENCH_KV_WRITE_IN_ATTENTION": "1"},
    # This script's child turns off TritonImpl.decode_early_loads (decode attention waits first).
    "latewait": {"BENCH_DECODE_LATE_WAIT": "1"},
    # Decode graphs every 8 requests (vLLM's default buckets) instead of at powers of two.
    "buckets8": {"BENCH_COMPILATION_CONFIG": json.dumps(
        {"cudagraph_capture_sizes": [1, 2, 4] + list(range(8, 257, 8))})},
    "unfolded": {"BENCH_GEMV_UNFOLDED": "1"},
    "fp8wunfolded": {"BENCH_QUANTIZATION": "fp8", "BENCH_GEMV_UNFOLDED": "1"},
    # The engine leaves its start-up objects in the garbage collector's full collections (engine/heap.py).
    "nogcfreeze": {"PAGEDLLM_GC_FREEZE": "0"},
}
_BENCH_SWITCHES = ("PAGEDLLM_PDL", "PAGEDLLM_TRITON_GEMM", "BENCH_FUSE_DECODE_QK_NORM", "BENCH_NO_DECODE_ORDER",
                   "BENCH_PAGED_CHUNK_KEYS", "BENCH_PROMPT_PER_HEAD", "BENCH_KV_CACHE_DTYPE",
                   "BENCH_FP8_FP16_DOTS", "BENCH_DECODE_PIECES", "BENCH_DECODE_PIECES_MIN", "BENCH_QUANTIZATION",
                   "PAGEDLLM_FP8_SKINNY", "BENCH_GEMV_UNFOLDED", "BENCH_KV_WRITE_IN_ATTENTION", "BENCH_DECODE_LATE_WAIT",
                   "BENCH_COMPILATION_CONFIG",
                   "PAGEDLLM_GC_FREEZE")


def _unfolded_gemv_config(n: int, k: int, float8: bool = False):
    """The GEMV's tiles before folded products: an element-wise accumulator, the same tiles for float8."""
    from pagedllm.kernels.gemv import GemvConfig

    block_k = next((b for b in (1024, 512, 256, 128) if k % b == 0), None)
    preferred = (8, 4, 16) if n <= 4096 and k >= 4096 else (4, 8, 16)
    block_n = next((b for b in preferred if n % b == 0), None)
    return None if block_k is None or block_n is None else GemvConfig(block_n, block_k, 4, fold=1)


def run_variant(args) -> dict:
    """In the child process: both workloads under this process's environment."""
    sys.path.insert(0, HERE)
    from gpu_measure import make_llm, run_generate, warm_up

    from pagedllm.entrypoints.bench.latency import measure_latency

    from pagedllm.attention.backends.triton import TritonImpl

    if os.environ.get("BENCH_FUSE_DECODE_QK_NORM") == "1":
        TritonImpl.fuse_decode_qk_norm = True
    if os.environ.get("BENCH_NO_DECODE_ORDER") == "1":
        TritonImpl.use_decode_order = False
    if os.environ.get("BENCH_PAGED_CHUNK_KEYS") == "1":
        TritonImpl.chunk_kv_from_step = False
    if os.environ.get("BENCH_PROMPT_PER_HEAD") == "1":
        TritonImpl.prompt_per_head = True
    if os.environ.get("BENCH_FP8_FP16_DOTS") == "1":
        TritonImpl.float8_fp16_dots = True
    if os.environ.get("BENCH_DECODE_PIECES"):
        TritonImpl.decode_pieces = os.environ["BENCH_DECODE_PIECES"] != "0"
        if os.environ["BENCH_DECODE_PIECES"] not in ("0", "1"):
            TritonImpl.decode_piece_len = int(os.environ["BENCH_DECODE_PIECES"])
        if os.environ.get("BENCH_DECODE_PIECES_MIN"):
            TritonImpl.decode_pieces_min_programs = int(os.environ["BENCH_DECODE_PIECES_MIN"])
    if os.environ.get("BENCH_KV_WRITE_IN_ATTENTION") == "1":
        TritonImpl.kv_written_by_caller = False
    if os.environ.get("BENCH_DECODE_LATE_WAIT") == "1":
        TritonImpl.decode_early_loads = False
    if os.environ.get("BENCH_GEMV_UNFOLDED") == "1":
        from pagedllm.kernels import gemv

        gemv.default_config = _unfolded_gemv_config
    out: dict = {}
    engine_kw = {"kv_cache_dtype": os.environ.get("BENCH_KV_CACHE_DTYPE", "auto"),
                 "quantization": os.environ.get("BENCH_QUANTIZATION") or None,
                 "compilation_config": os.environ.get("BENCH_COMPILATION_CONFIG") or None}
    if args.only_workload1:
        return {"workload1": _workload1(args, engine_kw)}
    llama = make_llm(args.smoke_model or LLAMA, args.smoke, **engine_kw)
    in_len, out_len = (1000, 256) if not args.smoke else (20, 8)
    out["batch1"] = measure_latency(llama, 1, in_len, out_len, num_iters=2, num_warmup=1)
    for b in (int(v) for v in args.batches.split(",") if v):
        out[f"batch{b}"] = measure_latency(llama, b, in_len, 128 if not args.smoke else 8, num_iters=2, num_warmup=1)
    if args.workload2:
        from gpu_measure import workload_fixed

        n, il, ol = (256, 1000, 1000) if not args.smoke else (12, 40, 30)
        warm_up(llama)
        reqs = workload_fixed(llama.llm_engine.config.model_config.vocab_size, n, il, ol)
        out["workload2"] = run_generate(llama, reqs)
    llama.llm_engine.engine_core.shutdown()
    del llama
    import gc

    gc.collect()
    if not args.smoke:
        import torch

        torch.cuda.empty_cache()
    if not args.no_workload1:
        out["workload1"] = _workload1(args, engine_kw)
    return out


def _workload1(args, engine_kw: dict) -> dict:
    from gpu_measure import make_llm, run_generate, warm_up, workload_qwen

    qwen = make_llm(args.smoke_model or QWEN, args.smoke, **engine_kw)
    vocab = qwen.llm_engine.config.model_config.vocab_size
    n, hi = (256, 1024) if not args.smoke else (12, 60)
    warm_up(qwen)
    return run_generate(qwen, workload_qwen(vocab, n=n, lo=min(100, hi // 2), hi=hi))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--variants", default="base,nopdl,gemm,qknorm,all")
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU: checks the script itself")
    ap.add_argument("--smoke-model", default=None)
    ap.add_argument("--timeout-s", type=float, default=240.0, help="per variant")
    ap.add_argument("--workload2", action="store_true", help="also run workload 2 (Llama-3-8B 256 x 1000/1000)")
    ap.add_argument("--only-workload1", action="store_true", help="run workload 1 alone")
    ap.add_argument("--no-workload1", action="store_true", help="skip workload 1 (the 8B runs alone)")
    ap.add_argument("--batches", default="", help="BATCH,...: also the 8B's time per output token at these batch "
                    "sizes (1000-token prompts, 128 output tokens)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.child:
        with open(args.child, "w") as f:
            json.dump(run_variant(args), f, indent=1, default=str)
        return

    results: dict = {}
    for i, variant in enumerate(v for v in args.variants.split(",") if v):
        # A variant named again (an A/B repeated in one run) is reported as name#2, name#3, ...
        name = variant if variant not in results else f"{variant}#{sum(k.split('#')[0] == variant for k in results) + 1}"
        env = {k: v for k, v in os.environ.items() if k not in _BENCH_SWITCHES}
        env.update(VARIANTS[variant])
        path = os.path.join(args.out, f"switch_{i}.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--child", path] + (["--workload2"] if args.workload2 else [])
        cmd += ["--only-workload1"] if args.only_workload1 else []
        cmd += (["--no-workload1"] if args.no_workload1 else []) + (["--batches", args.batches] if args.batches else [])
        if args.smoke:
            cmd += ["--smoke", "--smoke-model", args.smoke_model]
        t0 = time.time()
        try:
            proc = subprocess.run(cmd, env=env, timeout=args.timeout_s, capture_output=True, text=True)
            results[name] = json.load(open(path)) if proc.returncode == 0 else {"error": proc.stderr[-2000:]}
        except subprocess.TimeoutExpired:
            results[name] = {"error": f"timed out after {args.timeout_s:.0f} s"}
        results[name]["wall_s"] = time.time() - t0
        if os.path.exists(path):
            os.remove(path)  # one output file in all
        print(f"== {name}: {results[name].get('error', 'ok')[:300]} ({results[name]['wall_s']:.0f} s)", flush=True)
    with open(os.path.join(args.out, "engine_switches.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)

    base = results.get("base", {})
    print(f"\n{'variant':10s} {'8B batch-1 ms/token':>20s} {'vs base':>8s} {'Qwen wl1 tok/s':>15s} {'vs base':>8s}")
    for name, res in results.items():
        if "error" in res:
            print(f"{name:10s} {'failed':>20s}")
            continue
        tpot = res["batch1"]["tpot_ms"] if "batch1" in res else float("nan")
        tps = res["workload1"]["output_tok_per_s"] if "workload1" in res else float("nan")
        r1 = base["batch1"]["tpot_ms"] / tpot if "batch1" in base else float("nan")
        r2 = tps / base["workload1"]["output_tok_per_s"] if "workload1" in base else float("nan")
        line = f"{name:10s} {tpot:20.3f} {r1:8.3f} {tps:15.0f} {r2:8.3f}"
        if "batch1" in res:
            line += f"  | 8B 1000-token TTFT {res['batch1']['ttft_ms']:6.2f} ms"
        line += "".join(f"  | b{b} {res[f'batch{b}']['tpot_ms']:.3f} ms" for b in args.batches.split(",")
                        if f"batch{b}" in res)
        if "workload2" in res:
            w2 = res["workload2"]["output_tok_per_s"]
            r3 = w2 / base["workload2"]["output_tok_per_s"] if "workload2" in base else float("nan")
            line += f"  | 8B wl2 {w2:7.0f} tok/s ({r3:5.3f})"
        print(line)


if __name__ == "__main__":
    main()
