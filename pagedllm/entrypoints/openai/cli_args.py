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
    parser.add_argument("--trust-request-chat-template", action="store_true",
                        help="accept a chat_template in requests (a template is code the server runs, in a bounded "
                        "sandbox); refused with a 400 otherwise")
    parser.add_argument("--max-request-body-bytes", type=int, default=16 << 20)
    parser.add_argument("--max-header-bytes", type=int, default=16 << 10)
    parser.add_argument("--uvicorn-log-level", type=str, default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])
    parser.add_argument("--disable-access-log", action="store_true")
    parser.add_argument(
        "--shutdown-timeout", type=float, default=0.0,
        help="on SIGTERM or SIGINT, seconds that in-flight requests may take to finish before they end with a "
        "503 error (streams: an error event, then [DONE]); new requests get 503 meanwhile. Default 0: "
        "end them at once",
    )
    parser.add_argument("--timeout-keep-alive", type=float, default=5.0,
                        help="seconds an idle keep-alive connection stays open (uvicorn's and vLLM's default, 5)")
    parser.add_argument("--header-read-timeout", type=float, default=10.0,
                        help="seconds a client has, from opening a connection (or starting its next request), "
                        "to send the request line and headers; the connection is then closed with a 408")
    parser.add_argument("--body-read-timeout", type=float, default=30.0,
                        help="seconds a client may leave between two pieces of a request body; the connection "
                        "is then closed with a 408")
    parser.add_argument("--limit-concurrency", type=int, default=None,
                        help="most connections (and requests in progress) served at once; past it requests get "
                        "503, /health excepted (uvicorn's and vLLM's option; default: no limit)")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='accept tool_choice "auto" (the default with tools): tool calls are read from the '
                        "output by --tool-call-parser")
    parser.add_argument("--tool-call-parser", type=str, default=None,
                        choices=["hermes", "llama3_json", "mistral", "pythonic"],
                        help="how the model writes tool calls: hermes (Qwen2.5/Qwen3, Hermes), llama3_json (Llama 3.1+), "
                        "mistral ([TOOL_CALLS]), pythonic (Python calls, e.g. Gemma 3 and Llama 3.2 with a pythonic "
                        "template)")
    EngineArgs.add_cli_args(parser)
    # A server takes requests while steps run, so it schedules small decode steps just in time by
    # default (the offline LLM, whose requests are all there at the start, keeps it off).
    parser.set_defaults(submit_just_in_time=True)
    return parser


def run(args: argparse.Namespace) -> None:
    from pagedllm.entrypoints.openai.api_server import run_server

    run_server(args)
