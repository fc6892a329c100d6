"""ASGI plumbing of the server: the guard middleware (size limits, API keys), an SSE response that
notices disconnects at once, and a runner that cancels a non-streaming handler when its client leaves;
both also end their request with an error once a shutdown's drain time is over."""
from __future__ import annotations

import asyncio
import hmac
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Iterable

from starlette.responses import Response

from pagedllm.entrypoints.openai.errors import OpenAIError, error_json_bytes

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


async def send_error(send: Send, status: int, message: str, headers: Iterable[tuple[bytes, bytes]] = (), code: str | None = None) -> None:
    body = error_json_bytes(status, message, code=code)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers],
        }
    )
    await send({"type": "http.response.body", "body": body})


class GuardMiddleware:
    """Rejects oversized headers (431) and bodies (413), then missing or wrong API keys (401) on
    every path except the open ones. The body is read here, within the limit, and replayed to the
    app, so no handler ever sees more than max_body_bytes."""

    def __init__(
        self,
        app: Any,
        api_keys: list[str] | None = None,
        max_body_bytes: int = 16 << 20,
        max_header_bytes: int = 16 << 10,
        open_paths: tuple[str, ...] = ("/health",),
    ) -> None:
        self.app = app
        self.api_keys = [k.encode() for k in (api_keys or []) if k]
        self.max_body_bytes = max_body_bytes
        self.max_header_bytes = max_header_bytes
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = scope.get("headers") or []
        header_bytes = sum(len(k) + len(v) for k, v in headers)
        if header_bytes > self.max_header_bytes:
            await send_error(send, 431, f"Request headers are {header_bytes} bytes; the limit is {self.max_header_bytes}.")
            return
        length = _header(headers, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            await send_error(send, 413, f"Request body is {int(length)} bytes; the limit is {self.max_body_bytes}.")
            return
        if self.api_keys and scope.get("path") not in self.open_paths and not self._authorized(headers):
            await send_error(
                send, 401, "Missing or invalid API key (send it as 'Authorization: Bearer <key>').",
                headers=[(b"www-authenticate", b"Bearer")], code="invalid_api_key",
            )
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_body_bytes:
                await send_error(send, 413, f"Request body exceeds the limit of {self.max_body_bytes} bytes.")
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replay: list[dict[str, Any]] = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay_receive() -> dict[str, Any]:
            # The body once, then the real channel (which yields http.disconnect when the client goes).
            return replay.pop() if replay else await receive()

        await self.app(scope, replay_receive, send)

    def _authorized(self, headers: list[tuple[bytes, bytes]]) -> bool:
        value = _header(headers, b"authorization") or ""
        scheme, _, token = value.partition(" ")
        if scheme.lower() != "bearer":
            return False
        token_bytes = token.strip().encode()
        # Compare against every key, without stopping early, in constant time per key.
        ok = False
        for key in self.api_keys:
            ok |= hmac.compare_digest(token_bytes, key)
        return ok


@dataclass
class ShutdownDeadline:
    """Set once a shutdown's drain time is over: requests still running then end with `message`."""

    message: str = "The server is shutting down."
    expired: asyncio.Event = field(default_factory=asyncio.Event)

    status = 503
    code = "server_shutting_down"


# Set for each request by the server's lifecycle middleware; None when the app runs without one.
SHUTDOWN_DEADLINE: ContextVar[ShutdownDeadline | None] = ContextVar("pagedllm_shutdown_deadline", default=None)


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> str | None:
    for k, v in headers:
        if k.lower() == name:
            return v.decode("latin-1")
    return None


async def _wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class SSEResponse(Response):
    """text/event-stream of an async iterator of "data: ..." strings. A client disconnect cancels
    the iteration at once (not at the next write), which aborts the engine requests behind it;
    `on_close` runs whatever happens, even if the iterator never started."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None] | None = None, status_code: int = 200) -> None:
        # Response.__init__ would render a body; a stream has none, so only the fields we use are set.
        self.content = content
        self.on_close = on_close
        self.status_code = status_code
        self.background = None
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def stream() -> None:
            nonlocal started
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            started = True
            async for line in self.content:
                await send({"type": "http.response.body", "body": line.encode(), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        stream_task = asyncio.ensure_future(stream())
        listen_task = asyncio.ensure_future(_wait_for_disconnect(receive))
        deadline = SHUTDOWN_DEADLINE.get()
        tasks = [stream_task, listen_task]
        if deadline is not None:
            tasks.append(asyncio.ensure_future(deadline.expired.wait()))
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            if deadline is not None and tasks[2] in done and not stream_task.done() and not listen_task.done():
                stream_task.cancel()
                await asyncio.gather(stream_task, return_exceptions=True)
                await _end_for_shutdown(send, deadline, started)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            aclose = getattr(self.content, "aclose", None)
            if aclose is not None:
                await aclose()
            if self.on_close is not None:
                self.on_close()


async def _end_for_shutdown(send: Send, deadline: ShutdownDeadline, started: bool) -> None:
    """Ends a stream cut by the shutdown: an error event and [DONE] (or a JSON error if nothing was sent)."""
    body = error_json_bytes(deadline.status, deadline.message, code=deadline.code)
    if not started:
        await send_error(send, deadline.status, deadline.message, code=deadline.code)
        return
    await send({"type": "http.response.body", "body": b"data: " + body + b"\n\ndata: [DONE]\n\n", "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def run_until_disconnect(receive: Receive, work: Awaitable[Any]) -> tuple[bool, Any]:
    """Runs `work` (a non-streaming handler's body) unless the client disconnects first, in which
    case `work` is cancelled (its engine requests are aborted). Returns (completed, result). Raises
    a 503 OpenAIError, `work` cancelled, if a shutdown's drain time ends first."""
    task = asyncio.ensure_future(work)
    waiters = [task, asyncio.ensure_future(_wait_for_disconnect(receive))]
    deadline = SHUTDOWN_DEADLINE.get()
    if deadline is not None:
        waiters.append(asyncio.ensure_future(deadline.expired.wait()))
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        for w in waiters:
            w.cancel()
        raise
    for w in waiters[1:]:
        w.cancel()
    await asyncio.gather(*waiters[1:], return_exceptions=True)
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        if deadline is not None and deadline.expired.is_set():
            raise OpenAIError(deadline.status, deadline.message, code=deadline.code)
        return False, None
    return True, task.result()
