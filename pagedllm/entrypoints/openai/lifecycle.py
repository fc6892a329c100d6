"""The server's life after start-up: on SIGTERM or SIGINT it drains (no new requests, in-flight ones
get up to --shutdown-timeout seconds, then end with an error) and exits 0 once the engine core is
stopped; once the engine core has died it answers 503 and exits with status 1, so that a supervisor
(systemd, Kubernetes) starts it again."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from types import FrameType
from typing import Any, Iterator

import uvicorn

from pagedllm.entrypoints.openai.http_utils import SHUTDOWN_DEADLINE, Receive, Scope, Send, ShutdownDeadline, send_error

logger = logging.getLogger("pagedllm")

EXIT_ENGINE_DEAD = 1
# How long a server whose engine died still answers (503) before it stops listening: in-flight
# requests write their errors meanwhile, and a health check can read why.
DEAD_LINGER_S = 3.0
# uvicorn's own limit on the drain, past ours, only for requests that ignore our deadline (those
# still reading their body, say): theirs are cancelled when it passes.
_UVICORN_GRACE_S = 5.0


class ServerLifecycle:
    """Whether the server still takes requests, and when in-flight ones must end."""

    def __init__(self, shutdown_timeout_s: float) -> None:
        self.shutdown_timeout_s = shutdown_timeout_s
        self.draining = False
        self.dead_error: str | None = None
        self.deadline = ShutdownDeadline(
            f"The server is shutting down; the request did not finish within --shutdown-timeout "
            f"({shutdown_timeout_s:g} s)."
        )
        self.server: LifecycleServer | None = None

    @property
    def exit_status(self) -> int:
        return EXIT_ENGINE_DEAD if self.dead_error is not None else 0

    def refusal(self) -> tuple[str, str] | None:
        """(message, code) of the 503 that new requests get, or None while the server takes them."""
        if self.dead_error is not None:
            return f"The engine is dead: {self.dead_error}; the server is exiting.", "engine_dead"
        if self.draining:
            return "The server is shutting down and takes no new requests.", "server_shutting_down"
        return None

    def begin_drain(self, signame: str) -> None:
        """From the event loop, on the first SIGTERM/SIGINT; a second one ends in-flight requests now."""
        if self.draining:
            logger.warning("%s again: ending in-flight requests now", signame)
            self.deadline.expired.set()
            return
        self.draining = True
        logger.info(
            "%s: shutting down; new requests get 503, in-flight ones have %g s to finish (--shutdown-timeout)",
            signame, self.shutdown_timeout_s,
        )
        asyncio.get_running_loop().call_later(self.shutdown_timeout_s, self._expire)

    def _expire(self) -> None:
        if not self.deadline.expired.is_set():
            logger.info("--shutdown-timeout passed: ending the requests still in flight with an error")
            self.deadline.expired.set()

    def engine_died(self, message: str) -> None:
        """From the event loop, once the engine core is gone: refuse requests, then exit."""
        if self.dead_error is not None:
            return
        self.dead_error = message
        logger.error(
            "the engine core is dead (%s); the server exits with status %d in %g s so that its supervisor "
            "can restart it", message, EXIT_ENGINE_DEAD, DEAD_LINGER_S,
        )
        asyncio.get_running_loop().call_later(DEAD_LINGER_S, self._stop_serving)

    def _stop_serving(self) -> None:
        if self.server is not None:
            self.server.should_exit = True


class LifecycleMiddleware:
    """The outermost ASGI layer: 503 for every request (/health included) while draining or once the
    engine is dead; otherwise it hands the request the shutdown deadline (http_utils reads it)."""

    def __init__(self, app: Any, lifecycle: ServerLifecycle) -> None:
        self.app = app
        self.lifecycle = lifecycle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            refusal = self.lifecycle.refusal()
            if refusal is not None:
                message, code = refusal
                await send_error(send, 503, message, headers=[(b"connection", b"close")], code=code)
                return
            SHUTDOWN_DEADLINE.set(self.lifecycle.deadline)
        await self.app(scope, receive, send)


class LifecycleServer(uvicorn.Server):
    """uvicorn's server, with signals that start the drain and a normal return afterwards (uvicorn
    re-raises the signal once it has stopped, which would kill the process before the engine core is
    stopped and its socket directory removed)."""

    def __init__(self, config: uvicorn.Config, lifecycle: ServerLifecycle) -> None:
        super().__init__(config)
        self.lifecycle = lifecycle
        lifecycle.server = self

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A Python signal handler runs between two bytecodes of the loop's own thread: hand the
        # work to the loop rather than touch its state from here.
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # before the loop runs (start-up): nothing to drain
            self.should_exit = True
            return
        loop.call_soon_threadsafe(self.lifecycle.begin_drain, signal.Signals(sig).name)
        self.should_exit = True


def uvicorn_graceful_timeout(shutdown_timeout_s: float) -> float:
    return shutdown_timeout_s + _UVICORN_GRACE_S
