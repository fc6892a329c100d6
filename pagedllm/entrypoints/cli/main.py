"""The `pagedllm` command: generate, chat, serve and bench subcommands."""
from __future__ import annotations

import argparse
import logging
import sys


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedllm", description="Fast, exact LLM inference.")
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_command", required=True)
    from pagedllm.benchmarks import throughput
    from pagedllm.entrypoints.cli import chat, generate

    gen = sub.add_parser("generate", help="continue prompts, streaming the text (default model: Gemma 3 270M)")
    generate.add_cli_args(gen)
    gen.set_defaults(func=generate.run)
    ch = sub.add_parser("chat", help="interactive chat through the model's chat template")
    chat.add_cli_args(ch)
    ch.set_defaults(func=chat.run)

    tp = bench.add_parser("throughput", help="offline throughput on random prompts")
    throughput.add_cli_args(tp)
    tp.set_defaults(func=throughput.run)
    from pagedllm.benchmarks import latency

    lt = bench.add_parser("latency", help="time to first token and per output token, per batch size")
    latency.add_cli_args(lt)
    lt.set_defaults(func=latency.run)
    from pagedllm.benchmarks import serve as bench_serve
    from pagedllm.entrypoints.openai import cli_args as serve_args

    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    serve_args.add_cli_args(sv)
    sv.set_defaults(func=serve_args.run)
    bs = bench.add_parser("serve", help="load-test a running server with streaming requests")
    bench_serve.add_cli_args(bs)
    bs.set_defaults(func=bench_serve.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    args = _build_parser().parse_args(argv)
    try:
        args.func(args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
