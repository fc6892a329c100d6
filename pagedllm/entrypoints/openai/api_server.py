"""The OpenAI-compatible HTTP server: FastAPI app factory (build_app) and the uvicorn runner (run_server)."""
from __future__ import annotations

import argparse
import logging
import os
import signal
from contextlib import asynccontextmanager
from typing import Any

# FastAPI resolves handler annotations (Request) from module globals, so these imports live here;
# nothing imports this module unless a server is started.
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm import envs
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.entrypoints.openai.errors import (
    OpenAIError,
    bad_request,
    error_body,
    from_validation_error,
    internal_error_body,
)
from pagedllm.entrypoints.openai.http_utils import GuardMiddleware, SSEResponse, run_until_disconnect
from pagedllm.entrypoints.openai.openapi_bodies import request_body
from pagedllm.entrypoints.openai.blocking_pool import run_blocking
from pagedllm.entrypoints.openai.request_body import parse_request
from pagedllm.entrypoints.openai.serving_engine import ServerSettings, StreamingResult

logger = logging.getLogger("pagedllm")


async def _parse(request: Any, model_cls: Any) -> Any:
    """The JSON body as `model_cls`; every failure is a 400 in OpenAI's error shape."""
    return await run_blocking(parse_request, await request.body(), model_cls)


def build_app(
    engine: AsyncLLM,
    settings: ServerSettings,
    api_keys: list[str] | None = None,
    max_body_bytes: int = 16 << 20,
    max_header_bytes: int = 16 << 10,
    chat_template: str | None = None,
    trust_request_chat_template: bool = False,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
) -> Any:
    from pagedllm.version import __version__
    from pagedllm.entrypoints.openai import protocol as p
    from pagedllm.entrypoints.openai.reasoning_parsers import get_reasoning_parser
    from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
    from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
    from pagedllm.entrypoints.openai.tool_parsers import get_tool_parser
    from pagedllm.metrics.prometheus import PrometheusStatLogger

    metrics = PrometheusStatLogger(settings.served_model_names[0], num_engines=engine.engine_args.data_parallel_size)
    engine.add_stat_logger(metrics)
    completion = OpenAIServingCompletion(engine, settings)
    chat = OpenAIServingChat(
        engine, settings, chat_template, trust_request_chat_template,
        auto_tool_parser=get_tool_parser(tool_call_parser) if tool_call_parser else None,
        reasoning_parser=get_reasoning_parser(reasoning_parser) if reasoning_parser else None,
    )

    @asynccontextmanager
    async def lifespan(app: Any):
        engine.start()  # watch the core from the first moment, so /health turns 503 by itself
        yield

    app = FastAPI(title="pagedllm", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.settings = settings

    def error_response(err: OpenAIError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(from_validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(internal_error_body(exc, request.url.path), status_code=500)

    async def respond(request: Request, result: Any) -> Any:
        if isinstance(result, StreamingResult):
            return SSEResponse(result.content, on_close=result.close)
        return Response(result.model_dump_json(), media_type="application/json")

    async def serve(request: Request, work: Any) -> Any:
        completed, result = await run_until_disconnect(request.receive, work)
        if not completed:
            return Response(status_code=499)  # nobody is listening; the requests were aborted
        return await respond(request, result)

    @app.post("/v1/completions", openapi_extra=request_body(p.CompletionRequest))
    async def create_completion(request: Request):
        req = await _parse(request, p.CompletionRequest)
        if req.stream:
            return await respond(request, await completion.create_completion(req))
        return await serve(request, completion.create_completion(req))

    @app.post("/v1/chat/completions", openapi_extra=request_body(p.ChatCompletionRequest))
    async def create_chat_completion(request: Request):
        req = await _parse(request, p.ChatCompletionRequest)
        if req.stream:
            return await respond(request, await chat.create_chat_completion(req))
        return await serve(request, chat.create_chat_completion(req))

    @app.get("/v1/models")
    async def list_models():
        cards = [
            p.ModelCard(id=name, root=engine.model_config.model, max_model_len=engine.model_config.max_model_len)
            for name in settings.served_model_names
        ]
        return JSONResponse(p.ModelList(data=cards).model_dump())

    @app.get("/health")
    async def health():
        if engine.is_dead:
            return JSONResponse(error_body(503, f"The engine is dead: {engine.dead_error}"), status_code=503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def get_metrics():
        body, content_type = metrics.exposition()
        return Response(body, media_type=content_type)

    @app.get("/version")
    async def version():
        return JSONResponse(p.VersionResponse(version=__version__).model_dump())

    @app.post("/tokenize", openapi_extra=request_body(p.TokenizeRequest))
    async def tokenize(request: Request):
        req = await _parse(request, p.TokenizeRequest)
        completion.check_model(req.model)
        if completion.tokenizer is None:
            raise bad_request("this server runs without a tokenizer (--skip-tokenizer-init)")
        if req.messages is not None:
            tools = [t.model_dump(by_alias=True, exclude_none=True) for t in req.tools] if req.tools else None
            ids = (await chat.render(req.messages, req.chat_template, req.add_generation_prompt, tools=tools)).token_ids
        elif req.prompt is not None:
            ids = await run_blocking(completion.tokenizer.encode, req.prompt, add_special_tokens=req.add_special_tokens)
        else:
            raise bad_request("send either prompt or messages", param="prompt")
        out = p.TokenizeResponse(count=len(ids), max_model_len=completion.max_model_len, tokens=list(ids))
        return JSONResponse(out.model_dump())

    @app.post("/detokenize", openapi_extra=request_body(p.DetokenizeRequest))
    async def detokenize(request: Request):
        req = await _parse(request, p.DetokenizeRequest)
        completion.check_model(req.model)
        if completion.tokenizer is None:
            raise bad_request("this server runs without a tokenizer (--skip-tokenizer-init)")
        return JSONResponse(p.DetokenizeResponse(prompt=await run_blocking(_decode, completion, req.tokens)).model_dump())

    app.add_middleware(
        GuardMiddleware,
        api_keys=api_keys,
        max_body_bytes=max_body_bytes,
        max_header_bytes=max_header_bytes,
    )
    return app


def _decode(serving: Any, tokens: list[int]) -> str:
    bad = next((t for t in tokens if not 0 <= t < serving.vocab_size), None)
    if bad is not None:
        raise bad_request(f"tokens holds token id {bad}, outside the vocabulary [0, {serving.vocab_size})", param="tokens")
    return serving.tokenizer.decode(tokens)


def _read_chat_template(value: str | None) -> str | None:
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value) as f:
            return f.read()
    return value


def _http_stack() -> str:
    """The event loop and HTTP parser that uvicorn's "auto" settings pick in this environment."""
    names = []
    for module, fallback in (("uvloop", "asyncio"), ("httptools", "h11")):
        try:
            __import__(module)
            names.append(module)
        except ImportError:
            names.append(fallback)
    return " + ".join(names)


def run_server(args: argparse.Namespace) -> None:
    """`pagedllm serve`: start the engine core, then serve HTTP until SIGINT/SIGTERM (drained, exit 0)
    or the engine core's death (exit status 1)."""
    import prometheus_client
    import uvicorn

    from pagedllm.engine_args import EngineArgs
    from pagedllm.entrypoints.openai.http_limits import ConnectionLimits, protocol_class
    from pagedllm.entrypoints.openai.lifecycle import (
        LifecycleMiddleware,
        LifecycleServer,
        ServerLifecycle,
        uvicorn_graceful_timeout,
    )

    # The *_created series only add noise to a dashboard; this is process-wide, so it is set here,
    # by the process that owns the server, not by build_app.
    prometheus_client.disable_created_metrics()

    if getattr(args, "model_tag", None):
        args.model = args.model_tag
    default_name = None
    if not args.model:
        # Like `pagedllm generate`, serve the default model when none is named.
        from pagedllm.model_loader.default_model import default_model_path

        args.model = default_model_path()
        default_name = os.path.splitext(os.path.basename(args.model))[0]
    engine_args = EngineArgs.from_cli_args(args)
    names = args.served_model_name or [default_name or engine_args.model]
    api_keys = list(args.api_key or [])
    if envs.PAGEDLLM_API_KEY:
        api_keys.append(envs.PAGEDLLM_API_KEY)
    _check_server_args(args)
    # Until uvicorn takes the signals over, SIGTERM ends start-up through its cleanup (the engine core
    # stopped, its sockets removed), as Ctrl-C does.
    signal.signal(signal.SIGTERM, _exit_during_start_up)
    lifecycle = ServerLifecycle(args.shutdown_timeout)
    engine = AsyncLLM.from_engine_args(engine_args)
    try:
        engine.add_dead_callback(lifecycle.engine_died)
        settings = ServerSettings(
            served_model_names=names, max_n=args.max_n, max_waiting_requests=args.max_waiting_requests
        )
        app = build_app(
            engine,
            settings,
            api_keys=api_keys,
            max_body_bytes=args.max_request_body_bytes,
            max_header_bytes=args.max_header_bytes,
            chat_template=_read_chat_template(args.chat_template),
            trust_request_chat_template=args.trust_request_chat_template,
            # A parser reads calls only where the server accepts "auto" (vLLM's pairing of the two flags).
            tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
            reasoning_parser=args.reasoning_parser,
        )
        limits = ConnectionLimits(
            header_timeout_s=args.header_read_timeout,
            body_timeout_s=args.body_read_timeout,
            # Room for the request line and the separators, which GuardMiddleware's count leaves out.
            max_head_bytes=args.max_header_bytes + (8 << 10),
            limit_concurrency=args.limit_concurrency,
        )
        config = uvicorn.Config(
            LifecycleMiddleware(app, lifecycle),
            host=args.host,
            port=args.port,
            http=protocol_class(limits),
            ws="none",
            log_level=args.uvicorn_log_level,
            access_log=not args.disable_access_log,
            # Let headers up to 4x our own limit through h11, so oversized ones get a proper 431 from the app
            # or the protocol's cap.
            h11_max_incomplete_event_size=max(4 * args.max_header_bytes, 64 << 10),
            timeout_keep_alive=args.timeout_keep_alive,
            timeout_graceful_shutdown=uvicorn_graceful_timeout(args.shutdown_timeout),
        )
        server = LifecycleServer(config, lifecycle)
        logger.info("serving %s on http://%s:%d (%s)", ", ".join(names), args.host, args.port, _http_stack())
        # Server.run builds the loop uvicorn's "auto" picks: uvloop when installed, else asyncio's.
        server.run()
    finally:
        # A late signal must not cut the shutdown short; it is bounded by the core process's joins.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        engine.shutdown()
    if lifecycle.exit_status:
        logger.error("exiting with status %d: the engine core died (%s)", lifecycle.exit_status, lifecycle.dead_error)
        raise SystemExit(lifecycle.exit_status)
    logger.info("engine core stopped; server exits")


def _exit_during_start_up(signum: int, frame: Any) -> None:
    logger.info("%s during start-up: stopping", signal.Signals(signum).name)
    raise SystemExit(0)


def _check_server_args(args: argparse.Namespace) -> None:
    if args.max_n < 1:
        raise ValueError(f"--max-n must be >= 1, got {args.max_n}")
    for flag, least in (("shutdown_timeout", 0), ("timeout_keep_alive", 0), ("header_read_timeout", 1e-3), ("body_read_timeout", 1e-3)):
        value = getattr(args, flag)
        if not least <= value < float("inf"):
            raise ValueError(f"--{flag.replace('_', '-')} must be a finite number of seconds >= {least:g}, got {value}")
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (hermes, llama3_json, mistral or pythonic)")
    if args.limit_concurrency is not None and args.limit_concurrency < 1:
        raise ValueError(f"--limit-concurrency must be >= 1, got {args.limit_concurrency}")
