"""Connection limits that uvicorn's HTTP/1.1 protocols lack, as subclasses of them: a deadline for a
request's line and headers (counted from the connection's opening, or from the first byte of a later
request on it), a timeout between two pieces of a body, a cap on the bytes of a request head (httptools
sets none), and a cap on connections and requests in progress that answers 503 (/health excepted)."""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from pagedllm.entrypoints.openai.errors import error_json_bytes
from pagedllm.entrypoints.openai.http_utils import Receive, Scope, Send, send_error

logger = logging.getLogger("pagedllm")

_IDLE, _HEAD, _BODY = "idle", "head", "body"
_REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large"}
_CODES = {408: "request_timeout", 431: "request_head_too_large"}


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout_s: float
    body_timeout_s: float
    # Raw bytes of the request line and headers; GuardMiddleware's finer 431 (header names and values
    # only) stays the one clients normally see, as this cap is set above it.
    max_head_bytes: int
    limit_concurrency: int | None = None
    open_paths: tuple[str, ...] = ("/health",)


class _ConcurrencyGate:
    """503 for a request that finds more than `limit` connections or requests in progress (its own
    included), except on the open paths, so a health check still gets through."""

    def __init__(self, app: Any, server_state: Any, limits: ConnectionLimits) -> None:
        self.app = app
        self.state = server_state
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        limit = self.limits.limit_concurrency
        if (
            scope["type"] == "http"
            and scope.get("path") not in self.limits.open_paths
            and (len(self.state.connections) > limit or len(self.state.tasks) > limit)
        ):
            await send_error(
                send, 503,
                f"The server is at its limit of {limit} concurrent connections and requests "
                f"(--limit-concurrency); retry later.",
                headers=[(b"retry-after", b"1"), (b"connection", b"close")],
                code="too_many_connections",
            )
            return
        await self.app(scope, receive, send)


class _ReadLimits:
    """The parser-independent half; the subclasses below say when a head or a body is complete."""

    limits: ConnectionLimits
    # Set by uvicorn's protocol classes:
    app: Any
    cycle: Any
    flow: Any
    loop: asyncio.AbstractEventLoop
    server_state: Any
    transport: asyncio.Transport

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._phase = _IDLE
        self._head_bytes = 0
        self._timer: asyncio.TimerHandle | None = None
        if self.limits.limit_concurrency is not None:
            self.app = _ConcurrencyGate(self.app, self.server_state, self.limits)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # type: ignore[misc]
        self._begin_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)  # type: ignore[misc]

    def data_received(self, data: bytes) -> None:
        if self._phase == _IDLE:
            self._begin_head()
        was_head = self._phase == _HEAD
        super().data_received(data)  # type: ignore[misc]
        if self.transport.is_closing():
            self._disarm()
            return
        self._after_data()
        if self._phase == _HEAD and was_head:
            # Counted after parsing, so a head that ends in this piece is never refused for its body.
            self._head_bytes += len(data)
            if self._head_bytes > self.limits.max_head_bytes:
                self._refuse(
                    431, f"Request line and headers exceed {self.limits.max_head_bytes} bytes; the connection is closed."
                )
        elif self._phase == _BODY:
            self._arm(self.limits.body_timeout_s, self._body_timed_out)

    # ---- phases (called by the parser-specific subclasses) -----------------------------------------
    def _after_data(self) -> None:
        """Brings the phase up to date after the parser has taken a piece of data."""

    def _begin_head(self) -> None:
        self._phase = _HEAD
        self._head_bytes = 0
        self._arm(self.limits.header_timeout_s, self._head_timed_out)

    def _head_complete(self) -> None:
        self._phase = _BODY
        self._arm(self.limits.body_timeout_s, self._body_timed_out)

    def _message_complete(self) -> None:
        # Between requests the connection is the server's business (or uvicorn's keep-alive timeout's).
        self._phase = _IDLE
        self._disarm()

    # ---- timers ------------------------------------------------------------------------------------
    def _arm(self, seconds: float, callback: Any) -> None:
        self._disarm()
        self._timer = self.loop.call_later(seconds, callback)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _head_timed_out(self) -> None:
        self._timer = None
        self._refuse(408, f"The request line and headers did not arrive within {self.limits.header_timeout_s:g} s.")

    def _body_timed_out(self) -> None:
        self._timer = None
        if self.flow is not None and self.flow.read_paused:
            # Reading is paused because the app has not taken the body yet: the wait is ours, not the client's.
            self._arm(self.limits.body_timeout_s, self._body_timed_out)
            return
        self._refuse(408, f"The request body stalled for more than {self.limits.body_timeout_s:g} s.")

    def _refuse(self, status: int, message: str) -> None:
        """Answers `status` unless a response is already under way on this connection, and closes it."""
        self._disarm()
        if self.transport.is_closing():
            return
        logger.info("closing connection from %s: %s", _peer(self.transport), message)
        if self.cycle is None or self.cycle.response_complete or not self.cycle.response_started:
            body = error_json_bytes(status, message, code=_CODES[status])
            head = [b"HTTP/1.1 %d %s\r\n" % (status, _REASONS[status])]
            head += [name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers]
            head.append(
                b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(body)
            )
            self.transport.write(b"".join(head) + body)
        self.transport.close()


def _peer(transport: asyncio.Transport) -> str:
    peer = transport.get_extra_info("peername")
    return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else "?"


def protocol_class(limits: ConnectionLimits) -> type:
    """The uvicorn HTTP protocol class (httptools when installed, as uvicorn's "auto" picks, else h11)
    with `limits` applied; pass it as uvicorn.Config(http=...)."""
    try:
        import httptools  # noqa: F401
    except ImportError:
        return type("LimitedH11Protocol", (_H11Limits,), {"limits": limits})
    return type("LimitedHttpToolsProtocol", (_httptools_limits(),), {"limits": limits})


def _httptools_limits() -> type:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class _HttpToolsLimits(_ReadLimits, HttpToolsProtocol):
        def on_headers_complete(self) -> None:
            super().on_headers_complete()
            self._head_complete()

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._message_complete()

    return _HttpToolsLimits


class _H11Limits(_ReadLimits, H11Protocol):
    def _after_data(self) -> None:
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            if self._phase != _BODY:
                self._head_complete()
        elif state is not h11.IDLE or self._phase == _BODY:
            self._message_complete()
