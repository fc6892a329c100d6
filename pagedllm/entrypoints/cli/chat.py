"""`pagedllm chat`: an interactive terminal chat through the model's chat template."""
from __future__ import annotations

import argparse
import sys

from pagedllm.engine.output_processor import OutputKind
from pagedllm.engine_args import EngineArgs
from pagedllm.entrypoints.cli.sampling_args import add_sampling_args, sampling_params_from_args
from pagedllm.model_loader.tokenizer import chat_prompt_ids


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    EngineArgs.add_cli_args(parser)
    add_sampling_args(parser)
    parser.add_argument("--system", type=str, default=None, help="system message")


def _stream(engine, rid: str, prompt, params) -> str:
    engine.add_request(rid, prompt, params, OutputKind.DELTA)
    pieces = []
    while engine.has_unfinished_requests():
        for ro in engine.step():
            sys.stdout.write(ro.outputs[0].text)
            sys.stdout.flush()
            pieces.append(ro.outputs[0].text)
    sys.stdout.write("\n")
    return "".join(pieces)


def run(args: argparse.Namespace) -> None:
    from pagedllm.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
    tok = engine.get_tokenizer()
    params = sampling_params_from_args(args)
    has_template = getattr(tok, "chat_template", None) is not None
    if has_template:
        print("Chatting through the model's chat template. Empty line or Ctrl-D quits.", file=sys.stderr)
    else:
        print("This model has no chat template (a base model): each line you type is continued as plain "
              "text, with the conversation so far as context. Empty line or Ctrl-D quits.", file=sys.stderr)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    transcript = ""
    turn = 0
    while True:
        try:
            line = input("> " if sys.stdin.isatty() else "")
        except EOFError:
            break
        if not line.strip():
            break
        turn += 1
        if has_template:
            messages.append({"role": "user", "content": line})
            ids = chat_prompt_ids(tok, messages, add_generation_prompt=True)
            reply = _stream(engine, str(turn), {"prompt_token_ids": ids}, params)
            messages.append({"role": "assistant", "content": reply})
        else:
            transcript += line
            reply = _stream(engine, str(turn), transcript, params)
            transcript += reply + "\n"
