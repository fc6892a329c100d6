"""Where a step's device time goes: per kernel class (matmul, attention, norm, ...) for decode and prefill steps.

    python benchmarks/kernel_breakdown.py --model llama --decode 1:1000 --prefill 1000 --latency 1:1000:256
    python benchmarks/kernel_breakdown.py --model qwen --decode 256:640,64:1000 --prefill 14x560

Random weights, bf16, CUDA graphs as served (``--eager`` for the eager path). ``B:CTX`` profiles 16
decode steps of B requests with CTX-token prompts; ``L`` profiles the prefill of one L-token prompt and
prints the host time to enqueue its forward beside the device time (near equal: the prefill is host-bound).
"""
from __future__ import annotations

import argparse
import json
import os

from gpu_measure import kernel_profile, launch_overhead_us, make_llm, prefill_profile

HERE = os.path.dirname(os.path.abspath(__file__))
MODELS = {"qwen": os.path.join(HERE, "shapes", "qwen3-0.6b"), "llama": os.path.join(HERE, "shapes", "llama-3-8b"),
          "llama-awq": os.path.join(HERE, "shapes", "llama-3-8b-awq"),
          "llama-gptq": os.path.join(HERE, "shapes", "llama-3-8b-gptq")}


def print_profile(title: str, prof: dict) -> None:
    total = sum(prof["per_step_device_us"].values())
    print(f"\n== {title}: {total:8.1f} us device per step, {sum(prof['per_step_kernels'].values()):.0f} kernels")
    for cls, us in sorted(prof["per_step_device_us"].items(), key=lambda kv: -kv[1]):
        print(f"   {cls:18s} {us:8.1f} us  {prof['per_step_kernels'][cls]:6.1f} kernels")
    for name, us, count in prof["top"][:8]:
        print(f"   . {name:60s} {us:8.1f} us x{count:.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", choices=sorted(MODELS), default="llama")
    ap.add_argument("--decode", default="", help="comma-separated BATCH:CONTEXT")
    ap.add_argument("--prefill", default="", help="comma-separated prompt lengths, or NUMxLENGTH for NUM prompts in one step")
    ap.add_argument("--latency", default="", help="comma-separated BATCH:IN:OUT, timed end to end (TTFT, TPOT)")
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--quantization", default=None, help="e.g. fp8: float8 weights (the engine option)")
    ap.add_argument("--kv-cache-dtype", default="auto", help="e.g. fp8: a float8 KV cache (the engine option)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    llm = make_llm(MODELS[args.model], smoke=False, quantization=args.quantization,
                   kv_cache_dtype=args.kv_cache_dtype)
    results: dict = {}
    from pagedllm.entrypoints.bench.latency import measure_latency

    for spec in filter(None, args.latency.split(",")):
        batch, in_len, out_len = (int(v) for v in spec.split(":"))
        lat = measure_latency(llm, batch, in_len, out_len, num_iters=2, num_warmup=1)
        results[f"latency {spec}"] = lat
        print(f"== {args.model} latency batch {batch}, {in_len} in / {out_len} out: TTFT {lat['ttft_ms']:.2f} ms, "
              f"TPOT {lat['tpot_ms']:.3f} ms", flush=True)
    for spec in filter(None, args.decode.split(",")):
        batch, ctx = (int(v) for v in spec.split(":"))
        prof = kernel_profile(llm, batch, ctx, 16, args.eager)
        results[f"decode {spec}"] = prof
        print_profile(f"{args.model} decode batch {batch}, context {ctx}", prof)
    for spec in filter(None, args.prefill.split(",")):
        num, _, length = spec.rpartition("x")  # LENGTH, or NUMxLENGTH for NUM prompts in one step
        prof = prefill_profile(llm, int(length), num_prompts=int(num or 1))
        results[f"prefill {spec}"] = prof
        print_profile(f"{args.model} prefill of {num or 1} x {length} tokens", prof)
        if "host_forward_ms" in prof:
            print(f"   host time to enqueue the forward: {', '.join(f'{v:.1f}' for v in prof['host_forward_ms'])} ms; "
                  f"wall per prompt: {', '.join(f'{v:.1f}' for v in prof['wall_ms'])} ms", flush=True)
    if args.prefill:
        results["launch_overhead_us"] = launch_overhead_us()
        print("== host us per eager launch: " + ", ".join(f"{k} {v:.1f}" for k, v in results["launch_overhead_us"].items()))
    suffix = (f"_{args.quantization}" if args.quantization else "") + (
        f"_kv{args.kv_cache_dtype}" if args.kv_cache_dtype != "auto" else "")
    with open(os.path.join(args.out, f"kernel_breakdown_{args.model}{suffix}.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
