"""Serving overhead: `pagedllm serve` throughput at C concurrent streams over offline LLM.generate on the same prompts.

Both run the same model with max_num_seqs = C, greedy, EOS ignored, the same prompts and lengths.

    python benchmarks/serve_overhead.py [--model M] [--concurrency 16] [--num-prompts 48] [--output-json F]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time

from serve_process import Server  # a sibling module of this script


def serve_run(args, prompts) -> dict:
    from pagedllm.entrypoints.bench.serve import add_cli_args, benchmark

    flags = ([args.model] if args.model else []) + ["--max-num-seqs", str(args.concurrency), "--dtype", "float32"]
    server = Server(flags)
    try:
        server.wait_healthy(300)
        p = argparse.ArgumentParser()
        add_cli_args(p)
        bargs = p.parse_args([
            "--base-url", server.url, "--max-concurrency", str(args.concurrency),
            "--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len),
            "--output-len", str(args.output_len), "--random-range-ratio", str(args.range_ratio),
            "--seed", str(args.seed),
        ])
        summary, _ = asyncio.run(benchmark(bargs))
        return summary
    finally:
        server.stop()


def offline_run(args, prompts) -> dict:
    from pagedllm import LLM, SamplingParams

    llm = LLM(model=args.model, dtype="float32", device="cpu", max_num_seqs=args.concurrency)
    params = [SamplingParams(temperature=0.0, max_tokens=p.output_len, ignore_eos=True) for p in prompts]
    llm.generate(prompts[0].prompt, params[0], use_tqdm=False)  # warm-up, like the server's first request
    llm.llm_engine.engine_core.reset_prefix_cache()
    t0 = time.perf_counter()
    outs = llm.generate([p.prompt for p in prompts], params, use_tqdm=False)
    dt = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"duration_s": dt, "output_tokens": n, "output_throughput": n / dt}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: pagedllm's default model")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--range-ratio", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    from pagedllm.entrypoints.bench.serve import make_prompts

    prompts = make_prompts("random", args.num_prompts, args.input_len, args.output_len, args.range_ratio, args.seed)
    served = serve_run(args, prompts)
    offline = offline_run(args, prompts)
    ratio = served["output_throughput"] / offline["output_throughput"]
    res = {"served": served, "offline": offline, "ratio": ratio, "concurrency": args.concurrency}
    print(f"\n{'mode':10s} {'out tok/s':>10s}")
    print(f"{'served':10s} {served['output_throughput']:10.1f}  (completed {served['completed']}, failed {served['failed']})")
    print(f"{'offline':10s} {offline['output_throughput']:10.1f}")
    print(f"served / offline at {args.concurrency} concurrent streams: {ratio:.3f}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
