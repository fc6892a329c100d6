"""`pagedllm bench throughput`: offline throughput of LLM.generate on random prompts."""
from __future__ import annotations

import argparse
import json
import time

from pagedllm.entrypoints.bench.datasets import random_requests
from pagedllm.engine_args import EngineArgs


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    EngineArgs.add_cli_args(parser)
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--random-range-ratio", type=float, default=0.0)
    parser.add_argument("--output-json", type=str, default=None)
    parser.add_argument("--plot", type=str, default=None, help="write a PNG of the results here (the bench extra)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def run(args: argparse.Namespace) -> dict:
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.sampling_params import SamplingParams
    from pagedllm.entrypoints.bench.plots import plot_throughput, require_matplotlib

    require_matplotlib(args.plot)
    engine_args = EngineArgs.from_cli_args(args)
    if engine_args.load_format == "dummy" and engine_args.tokenizer is None:
        # Random weights usually come from a bare config.json: no tokenizer to load.
        engine_args.skip_tokenizer_init = True
    t0 = time.perf_counter()
    llm = LLM(**{k: v for k, v in vars(engine_args).items()})
    startup_s = time.perf_counter() - t0
    vocab = llm.llm_engine.config.model_config.vocab_size
    max_len = llm.llm_engine.config.model_config.max_model_len
    reqs = random_requests(args.num_prompts, args.input_len, args.output_len, vocab, args.random_range_ratio, args.seed)
    for r in reqs:
        if len(r.prompt_token_ids) + r.output_len > max_len:
            raise ValueError(
                f"input {len(r.prompt_token_ids)} + output {r.output_len} tokens exceed max_model_len {max_len}"
            )
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in reqs]
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=r.output_len, detokenize=not engine_args.skip_tokenizer_init) for r in reqs]
    t0, start = time.perf_counter(), time.monotonic()
    outputs = llm.generate(prompts, params, use_tqdm=not args.no_progress)
    elapsed = time.perf_counter() - t0
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    num_in = sum(len(r.prompt_token_ids) for r in reqs)
    result = {
        "model": engine_args.model,
        "num_prompts": len(reqs),
        "elapsed_s": elapsed,
        "startup_s": startup_s,
        "requests_per_s": len(reqs) / elapsed,
        "output_tokens_per_s": num_out / elapsed,
        "total_tokens_per_s": (num_in + num_out) / elapsed,
        "num_input_tokens": num_in,
        "num_output_tokens": num_out,
        "device": llm.llm_engine.config.device_config.device,
        "dtype": str(llm.llm_engine.config.model_config.dtype).replace("torch.", ""),
    }
    print(
        f"Throughput: {result['requests_per_s']:.2f} requests/s, "
        f"{result['output_tokens_per_s']:.2f} output tokens/s, {result['total_tokens_per_s']:.2f} total tokens/s "
        f"({len(reqs)} prompts, {num_in} input + {num_out} output tokens in {elapsed:.2f} s)"
    )
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    if args.plot:
        plot_throughput(args.plot, start, [o.metrics["arrival_time"] for o in outputs],
                        [o.metrics["finished_time"] for o in outputs])
    return result
