"""`pagedllm serve` command-line flags (server flags plus every EngineArgs flag); imports no server packages."""
from __future__ import annotations

import argparse

from pagedllm.engine_args import EngineArgs


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("model_tag", nargs="?", default=None, help="model directory, .gguf file or hub id (or --model)")
    parser.add_argument("--host", type=str, default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--api-key", type=str, nargs="+", action="extend", default=None,
        help="accepted API key(s); every route but /health then needs 'Authorization: Bearer KEY' "
        "(PAGEDLLM_API_KEY adds one more)",
    )
    parser.add_argument("--served-model-name", type=str, nargs="+", default=None,
                        help="model name(s) clients use; the first one is reported in responses")
    parser.add_argument("--max-waiting-requests", type=int, default=None,
                        help="answer 429 while more accepted requests than this have not started")
    parser.add_argument("--max-n", type=int, default=128, help="largest n a request may ask for")
    parser.add_argument("--chat-template", type=str, default=None, help="Jinja chat template, or a file holding one")
    parser.add_argument("--max-request-body-bytes", type=int, default=16 << 20)
    parser.add_argument("--max-header-bytes", type=int, default=16 << 10)
    parser.add_argument("--uvicorn-log-level", type=str, default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])
    parser.add_argument("--disable-access-log", action="store_true")
    EngineArgs.add_cli_args(parser)
    # A server takes requests while steps run, so it schedules small decode steps just in time by
    # default (the offline LLM, whose requests are all there at the start, keeps it off).
    parser.set_defaults(submit_just_in_time=True)
    return parser


def run(args: argparse.Namespace) -> None:
    from pagedllm.entrypoints.openai.api_server import run_server

    run_server(args)
