"""The `pagedllm` command: generate, chat, serve and bench subcommands."""
from __future__ import annotations

import argparse
import importlib
import logging
import sys


# (subcommand path, module exposing add_cli_args/run, help); modules load only when the CLI starts.
_COMMANDS = (
    (("generate",), "pagedllm.entrypoints.cli.generate", "continue prompts, streaming the text (default model: Gemma 3 270M)"),
    (("chat",), "pagedllm.entrypoints.cli.chat", "interactive chat through the model's chat template"),
    (("serve",), "pagedllm.entrypoints.openai.cli_args", "OpenAI-compatible HTTP server"),
    (("bench", "throughput"), "pagedllm.entrypoints.bench.throughput", "offline throughput on random prompts"),
    (("bench", "latency"), "pagedllm.entrypoints.bench.latency", "time to first token and per output token, per batch size"),
    (("bench", "serve"), "pagedllm.entrypoints.bench.serve", "load-test a running server with streaming requests"),
)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedllm", description="Fast, exact LLM inference.")
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_command", required=True)
    for path, module_name, help_text in _COMMANDS:
        module = importlib.import_module(module_name)
        cmd = (bench if path[0] == "bench" else sub).add_parser(path[-1], help=help_text)
        module.add_cli_args(cmd)
        cmd.set_defaults(func=module.run)
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
