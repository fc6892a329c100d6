"""A/B of the engine's options on the issue's workloads, each variant in a fresh process.

    PYTHONPATH=$PWD python3 benchmarks/engine_switches.py --out $OUT [--variants base,fp8kv,fp8w,fp8all]

Variants over the defaults (``base``): ``nopdl`` turns programmatic dependent launch off (PAGEDLLM_PDL=0;
on by default on sm90), ``nogcfreeze`` leaves the engine's start-up objects in the garbage collector's
full collections (PAGEDLLM_GC_FREEZE=0, ``engine/heap.py``); ``fp8kv`` keeps the KV cache in float8 e4m3
(``kv_cache_dtype="fp8"``), ``fp8w`` quantizes the weights to float8 at load (``quantization="fp8"``),
``fp8all`` does both, ``int8w`` quantizes them to int8 (W8A8) at load; ``awq4`` and ``gptq4`` run the 8B's
shape as a 4-bit group-128 AWQ / GPTQ checkpoint (random packed weights, the wna16 kernel), ``fp8block`` as a
block-wise float8 checkpoint (128x128 blocks, ``kernels/fp8_block.py``), ``int8asym`` as a W8A8 checkpoint whose
activations take a zero point per token; ``buckets8`` captures decode graphs every 8 requests, as vLLM does, through
``compilation_config``. Each variant runs (1) workload 3, Llama-3-8B batch 1, 1000-token prompt, time
per output token, and (2) workload 1, Qwen3-0.6B 256 prompts in/out U[100, 1024], output tok/s; with
``--workload2`` also (3) workload 2, with ``--batches 2,4,...`` the 8B's time per output token at those
batch sizes, and with ``--no-workload1`` not (2). Random weights, bf16, greedy. Prints a table of the
figures per variant and their ratio to ``base``; writes one JSON file.
``--smoke`` runs the same code with a tiny model on the CPU (the GPU options are then inert).
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
# Environment of each variant's child: the engine's own PAGEDLLM_* variables, or BENCH_* ones that this
# script's child turns into engine options.
VARIANTS = {
    "base": {},
    "nopdl": {"PAGEDLLM_PDL": "0"},
    "nogcfreeze": {"PAGEDLLM_GC_FREEZE": "0"},
    "fp8kv": {"BENCH_KV_CACHE_DTYPE": "fp8"},
    "fp8w": {"BENCH_QUANTIZATION": "fp8"},
    "fp8all": {"BENCH_QUANTIZATION": "fp8", "BENCH_KV_CACHE_DTYPE": "fp8"},
    "int8w": {"BENCH_QUANTIZATION": "int8"},
    # Checkpoint formats: the 8B's shape with the quantization_config of a published AWQ / GPTQ checkpoint.
    "awq4": {"BENCH_LLAMA_SHAPE": "llama-3-8b-awq"},
    "gptq4": {"BENCH_LLAMA_SHAPE": "llama-3-8b-gptq"},
    "fp8block": {"BENCH_LLAMA_SHAPE": "llama-3-8b-fp8-block"},
    "int8asym": {"BENCH_LLAMA_SHAPE": "llama-3-8b-w8a8-asym"},
    # Decode graphs every 8 requests (vLLM's default buckets) instead of at powers of two.
    "buckets8": {"BENCH_COMPILATION_CONFIG": json.dumps(
        {"cudagraph_capture_sizes": [1, 2, 4] + list(range(8, 257, 8))})},
}
_BENCH_SWITCHES = ("PAGEDLLM_PDL", "PAGEDLLM_GC_FREEZE", "BENCH_KV_CACHE_DTYPE", "BENCH_QUANTIZATION",
                   "BENCH_COMPILATION_CONFIG", "BENCH_LLAMA_SHAPE")


def run_variant(args) -> dict:
    """In the child process: both workloads under this process's environment."""
    sys.path.insert(0, HERE)
    from gpu_measure import make_llm, run_generate, warm_up

    from pagedllm.entrypoints.bench.latency import measure_latency

    out: dict = {}
    engine_kw = {"kv_cache_dtype": os.environ.get("BENCH_KV_CACHE_DTYPE", "auto"),
                 "quantization": os.environ.get("BENCH_QUANTIZATION") or None,
                 "compilation_config": os.environ.get("BENCH_COMPILATION_CONFIG") or None}
    if args.only_workload1:
        return {"workload1": _workload1(args, engine_kw)}
    shape = os.environ.get("BENCH_LLAMA_SHAPE")
    llama = make_llm(args.smoke_model or (os.path.join(HERE, "shapes", shape) if shape else LLAMA), args.smoke,
                     **engine_kw)
    in_len, out_len = (1000, 256) if not args.smoke else (20, 8)
    out["batch1"] = measure_latency(llama, 1, in_len, out_len, num_iters=2, num_warmup=1)
    for b in (int(v) for v in args.batches.split(",") if v):
        out[f"batch{b}"] = measure_latency(llama, b, in_len, 128 if not args.smoke else 8, num_iters=2, num_warmup=1)
    if args.workload2:
        from gpu_measure import StepRecorder, workload_fixed

        n, il, ol = (256, 1000, 1000) if not args.smoke else (12, 40, 30)
        warm_up(llama)
        reqs = workload_fixed(llama.llm_engine.config.model_config.vocab_size, n, il, ol)
        recorder = StepRecorder(llama)
        out["workload2"] = run_generate(llama, reqs, recorder)
        out["workload2"]["steps"] = _step_split(recorder.steps, n)
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


def _step_split(steps: list[dict], full_batch: int) -> dict:
    """Where workload 2's wall time went: steps that carry prompt tokens against pure decode steps."""
    import statistics

    prompt = [s for s in steps if s["tokens"] > s["reqs"]]
    decode = [s for s in steps if s["tokens"] == s["reqs"]]
    full = [s["step_s"] for s in decode if s["reqs"] == full_batch]
    return {"prompt_steps": len(prompt), "prompt_s": sum(s["step_s"] for s in prompt),
            "prompt_tokens": sum(s["tokens"] - s["reqs"] for s in prompt),
            "decode_steps": len(decode), "decode_s": sum(s["step_s"] for s in decode),
            "full_batch_decode_steps": len(full),
            "full_batch_decode_median_ms": 1e3 * statistics.median(full) if full else None}


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
    ap.add_argument("--variants", default="base,nopdl,fp8kv,fp8w", help=f"comma-separated, of {','.join(VARIANTS)}")
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
        res = results[name]
        figures = "".join(f" {key} {res[key][field]:.{digits}f}" for key, field, digits in (
            ("batch1", "tpot_ms", 3), ("workload2", "output_tok_per_s", 0), ("workload1", "output_tok_per_s", 0))
            if key in res)  # as each variant ends: a run cut short still tells what it measured
        st = res.get("workload2", {}).get("steps")
        if st:  # where workload 2's time went, printed as each variant ends
            figures += f" (prompt steps {st['prompt_s']:.2f} s, decode steps {st['decode_s']:.2f} s)"
        print(f"== {name}: {res.get('error', 'ok')[:300]}{figures} ({res['wall_s']:.0f} s)", flush=True)
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
            st = res["workload2"].get("steps")
            if st:
                line += (f" prompt steps {st['prompt_s']:.2f} s, decode {st['decode_s']:.2f} s"
                         f" (full batch {st['full_batch_decode_median_ms'] or float('nan'):.2f} ms)")
        print(line)


if __name__ == "__main__":
    main()
