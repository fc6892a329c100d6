"""The fastest each throughput workload could run on a GPU, from its requests and the model's shape alone: no GPU.

Replays the issue's workloads 1 (Qwen3-0.6B, 256 requests, in/out uniform in [100, 1024], the prompts of
``gpu_measure.workload_qwen``) and 2 (Llama-3-8B, 256 x 1000/1000) as one prefill of every prompt, then
one decode step per output token with the requests still running. Each decode step reads every weight
once (the LM head included) and the KV cache of every running request; it multiplies 2 x params FLOP
per token plus the attention's 4 x head_dim FLOP per (query head, cached token). Three floors:

- ``overlap``: each step as long as the larger of its bytes over the read ceiling and its FLOPs over
  the product peak (memory and compute fully overlapped; no engine is faster);
- ``serial``: a step's KV reads, then its products (each at its own ceiling), as a layer runs them one
  after the other on the same SMs;
- ``serial + fixed``: plus ``--fixed-ms`` a decode step (launch gaps and small kernels; workload 1's
  step-time fit on an H200 gave 1.5 ms).

Prefill counts its products and causal attention at the product peak in every floor. The output is
each floor's time and tokens/s, and the time each target allows.

    python3 benchmarks/workload_floors.py [--read-tbps 4.54] [--tflops 785] [--fixed-ms 1.5]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from gpu_measure import workload_fixed, workload_qwen  # noqa: E402 - a sibling module: the workloads' prompts

# (workload, shape directory, target output tok/s)
WORKLOADS = (("1. Qwen3-0.6B, 256 x U[100, 1024]", "qwen3-0.6b", 30_000),
             ("2. Llama-3-8B, 256 x 1000/1000", "llama-3-8b", 12_000))


def model_figures(shape_dir: str) -> dict:
    """Bytes and FLOPs of one token from a config.json (bf16 weights and cache)."""
    with open(os.path.join(shape_dir, "config.json")) as f:
        cfg = json.load(f)
    hidden, layers, inter = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    per_layer = (heads + 2 * kv_heads) * head_dim * hidden + hidden * heads * head_dim + 3 * hidden * inter
    params = layers * per_layer + cfg["vocab_size"] * hidden  # the LM head is read every step, tied or not
    return {
        "weight_bytes": 2 * params,
        "flops_per_token": 2 * params,
        "kv_bytes_per_token": layers * 2 * kv_heads * head_dim * 2,
        "attn_flops_per_pair": 4 * head_dim * heads * layers,  # q.k and p.v for every query head
    }


def floors(requests: list[tuple[int, int]], fig: dict, read_bps: float, flops: float, fixed_s: float) -> dict:
    """Seconds of each floor for (prompt length, output length) requests."""
    prefill = sum(i * fig["flops_per_token"] + i * (i + 1) // 2 * fig["attn_flops_per_pair"] for i, _ in requests) / flops
    overlap = serial = 0.0
    steps = 0
    for step in range(1, max(o for _, o in requests)):  # the first token of each request comes from its prefill
        contexts = [i + step for i, o in requests if step < o]
        ctx = sum(contexts)
        kv_s = ctx * fig["kv_bytes_per_token"] / read_bps
        weights_s = fig["weight_bytes"] / read_bps
        linear_s = len(contexts) * fig["flops_per_token"] / flops
        attn_s = ctx * fig["attn_flops_per_pair"] / flops
        overlap += max(kv_s + weights_s, linear_s + attn_s)
        serial += max(kv_s, attn_s) + max(weights_s, linear_s)
        steps += 1
    return {"prefill_s": prefill, "decode_steps": steps, "overlap_s": prefill + overlap, "serial_s": prefill + serial,
            "serial_fixed_s": prefill + serial + steps * fixed_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--read-tbps", type=float, default=4.54, help="read ceiling (H200, memory_ceilings.py)")
    ap.add_argument("--tflops", type=float, default=785.0, help="bf16 product peak (H200, an 8192^3 matmul)")
    ap.add_argument("--fixed-ms", type=float, default=1.5, help="fixed cost of a decode step")
    args = ap.parse_args()
    for name, shape, target in WORKLOADS:
        fig = model_figures(os.path.join(HERE, "shapes", shape))
        if shape.startswith("qwen"):
            reqs = [(len(p), o) for p, o in workload_qwen(151936)]
        else:
            reqs = [(len(p), o) for p, o in workload_fixed(128256, 256, 1000, 1000)]
        out_tokens = sum(o for _, o in reqs)
        res = floors(reqs, fig, args.read_tbps * 1e12, args.tflops * 1e12, args.fixed_ms * 1e-3)
        target_s = out_tokens / target
        print(f"{name}: {out_tokens:,} output tokens, {res['decode_steps']} decode steps, prefill "
              f"{res['prefill_s']:.2f} s at the product peak")
        for key, label in (("overlap_s", "overlap"), ("serial_s", "serial"),
                           ("serial_fixed_s", f"serial + {args.fixed_ms:g} ms a step")):
            print(f"   {label:24s} {res[key]:6.2f} s  {out_tokens / res[key]:8,.0f} tok/s")
        spare = (target_s - res["serial_s"]) / res["decode_steps"] * 1e3
        print(f"   target {target:,} tok/s: {target_s:.2f} s, leaving {spare:.2f} ms a decode step over the serial floor")


if __name__ == "__main__":
    main()
