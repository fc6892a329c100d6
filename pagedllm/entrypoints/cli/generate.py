"""`pagedllm generate`: complete prompts on the terminal, streaming text as the engine produces it."""
from __future__ import annotations

import argparse
import sys
import time

from pagedllm.engine.output_processor import OutputKind
from pagedllm.engine_args import EngineArgs
from pagedllm.entrypoints.cli.sampling_args import add_sampling_args, sampling_params_from_args


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompts", nargs="+", metavar="PROMPT", help="text to continue")
    EngineArgs.add_cli_args(parser)
    add_sampling_args(parser)
    parser.add_argument("--timing", action="store_true", help="print startup and first-token times to stderr")


def run(args: argparse.Namespace) -> None:
    from pagedllm.engine.llm_engine import LLMEngine

    t_start = time.perf_counter()
    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
    t_ready = time.perf_counter()
    params = sampling_params_from_args(args)
    out = sys.stdout
    stream = len(args.prompts) == 1
    for i, prompt in enumerate(args.prompts):
        engine.add_request(str(i), prompt, params, OutputKind.DELTA if stream else OutputKind.FINAL_ONLY)
    t_first = None
    if stream:
        out.write(args.prompts[0])
        out.flush()
    while engine.has_unfinished_requests():
        for ro in engine.step():
            text = ro.outputs[0].text
            if stream:
                if t_first is None and ro.outputs[0].token_ids:
                    t_first = time.perf_counter()
                out.write(text)
                out.flush()
            else:
                out.write(f"=== {ro.prompt}\n{ro.prompt}{text}\n")
    if stream:
        out.write("\n")
    if args.timing:
        first = f"{t_first - t_start:.2f}" if t_first else "n/a"
        print(f"startup {t_ready - t_start:.2f} s, first token after {first} s, "
              f"total {time.perf_counter() - t_start:.2f} s", file=sys.stderr)
