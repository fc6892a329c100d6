"""`pagedllm bench latency`: time to first token and time per output token of one batch, per batch size.

Each measurement sends ``batch_size`` fresh random prompts of ``input_len`` tokens at once (greedy, EOS
ignored): TTFT is the time of a run that stops after one token, and TPOT is (full run - TTFT) /
(output_len - 1). Every run draws new prompts, so the prefix cache never shortens a prefill.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from pagedllm.entrypoints.bench.datasets import random_requests
from pagedllm.engine_args import EngineArgs


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    EngineArgs.add_cli_args(parser)
    parser.add_argument("--batch-size", type=str, default="1", help="one or more, comma-separated: 1,8,32")
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-iters", type=int, default=3, help="timed runs per batch size (median)")
    parser.add_argument("--num-iters-warmup", type=int, default=1)
    parser.add_argument("--output-json", type=str, default=None)
    parser.add_argument("--plot", type=str, default=None, help="write a PNG of the results here (the bench extra)")


def parse_batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"--batch-size takes comma-separated integers, got {text!r}") from None
    if not sizes or any(s < 1 for s in sizes):
        raise ValueError(f"--batch-size takes integers >= 1, got {text!r}")
    return sizes


def measure_latency(
    llm: Any,
    batch_size: int,
    input_len: int,
    output_len: int,
    num_iters: int = 3,
    num_warmup: int = 1,
    seed: int = 0,
) -> dict:
    """TTFT and TPOT (ms, medians over ``num_iters``) of ``batch_size`` prompts sent together."""
    from pagedllm.sampling_params import SamplingParams

    config = llm.llm_engine.config
    vocab = config.model_config.vocab_size
    if input_len + output_len > config.model_config.max_model_len:
        raise ValueError(
            f"input_len {input_len} + output_len {output_len} exceed max_model_len {config.model_config.max_model_len}"
        )
    if batch_size > config.scheduler_config.max_num_seqs:
        raise ValueError(f"batch size {batch_size} exceeds max_num_seqs {config.scheduler_config.max_num_seqs}")
    detok = llm.llm_engine.tokenizer is not None
    run_index = 0

    def run(max_tokens: int) -> float:
        nonlocal run_index
        run_index += 1
        reqs = random_requests(batch_size, input_len, max_tokens, vocab, 0.0, seed=seed * 100_003 + run_index)
        prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in reqs]
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens, detokenize=detok)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        got = sum(len(o.outputs[0].token_ids) for o in outs)
        if got != batch_size * max_tokens:
            raise RuntimeError(f"expected {batch_size * max_tokens} output tokens, got {got}")
        return elapsed

    for _ in range(num_warmup):
        run(output_len)
    ttfts, totals = [], []
    for _ in range(num_iters):
        ttfts.append(run(1))
        totals.append(run(output_len))
    ttft, total = statistics.median(ttfts), statistics.median(totals)
    tpot = (total - ttft) / (output_len - 1) if output_len > 1 else 0.0
    return {
        "batch_size": batch_size,
        "input_len": input_len,
        "output_len": output_len,
        "ttft_ms": 1e3 * ttft,
        "tpot_ms": 1e3 * tpot,
        "e2e_ms": 1e3 * total,
        "output_tokens_per_s": batch_size * output_len / total,
        "ttft_runs_ms": [1e3 * t for t in ttfts],
        "e2e_runs_ms": [1e3 * t for t in totals],
    }


def run(args: argparse.Namespace) -> list[dict]:
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.entrypoints.bench.plots import plot_latency, require_matplotlib

    require_matplotlib(args.plot)
    sizes = parse_batch_sizes(args.batch_size)
    if args.output_len < 1 or args.input_len < 1:
        raise ValueError("--input-len and --output-len must be >= 1")
    engine_args = EngineArgs.from_cli_args(args)
    if engine_args.load_format == "dummy" and engine_args.tokenizer is None:
        # Random weights usually come from a bare config.json: no tokenizer to load.
        engine_args.skip_tokenizer_init = True
    engine_args.max_num_seqs = max(engine_args.max_num_seqs, max(sizes))
    t0 = time.perf_counter()
    llm = LLM(**vars(engine_args))
    startup_s = time.perf_counter() - t0
    results = []
    print(f"{'batch':>6} {'TTFT ms':>10} {'TPOT ms':>10} {'E2E ms':>10} {'out tok/s':>11}")
    for bs in sizes:
        r = measure_latency(llm, bs, args.input_len, args.output_len, args.num_iters, args.num_iters_warmup, args.seed)
        results.append(r)
        print(f"{bs:6d} {r['ttft_ms']:10.2f} {r['tpot_ms']:10.3f} {r['e2e_ms']:10.1f} {r['output_tokens_per_s']:11.1f}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"model": engine_args.model, "startup_s": startup_s, "results": results}, f, indent=2)
    if args.plot:
        plot_latency(args.plot, results)
    return results
