"""CoreClient: starts the engine-core process and talks to it over two local ZMQ sockets.

Layout: the front-end binds a PUSH socket (inputs) and a PULL socket (outputs) on ipc:// paths in a
private temporary directory; the spawned core process connects to both. Inputs are sent from the
event loop without blocking (unbounded high-water mark); outputs are read by one asyncio task of the
owner (AsyncLLM) through `recv()`. The process's sentinel is watched by the event loop, so a core
that dies without a word (OOM kill, segfault) is noticed at once and reported through `on_dead`.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import shutil
import signal
import tempfile
import time
from typing import Any, Callable

from pagedllm.core.request import Request
from pagedllm.engine import core_messages as m
from pagedllm.engine_args import EngineArgs

logger = logging.getLogger("pagedllm")

_STARTUP_POLL_MS = 200


class EngineDeadError(RuntimeError):
    """The engine-core process has stopped; no request can be served any more."""


class CoreClient:
    def __init__(self, engine_args: EngineArgs) -> None:
        import multiprocessing

        import zmq

        from pagedllm.engine.core_proc import run_engine_core

        self._zmq = zmq
        self._async_output = None
        self._encoder = m.input_encoder()
        self._decoder = m.output_decoder()
        self._call_ids = itertools.count()
        self._pending_calls: dict[int, asyncio.Future] = {}
        self.dead_error: str | None = None
        self.on_dead: Callable[[str], None] | None = None
        self._watching = False
        self._closed = False
        self._shutdown_sent = False
        self.num_blocks = 0
        self._ctx = self._input = self._output = self.proc = None
        self._tmpdir = tempfile.mkdtemp(prefix="pagedllm-core-")
        try:
            self._start(engine_args, run_engine_core, multiprocessing.get_context("spawn"))
        except BaseException:
            # A failed spawn, or a signal during start-up (SIGTERM), leaves no process or socket behind.
            self.shutdown()
            raise

    def _start(self, engine_args: EngineArgs, target: Callable[..., None], mp: Any) -> None:
        zmq = self._zmq
        input_addr = f"ipc://{self._tmpdir}/input"
        output_addr = f"ipc://{self._tmpdir}/output"
        self._ctx = zmq.Context()
        self._input = self._ctx.socket(zmq.PUSH)
        self._input.setsockopt(zmq.SNDHWM, 0)
        self._input.setsockopt(zmq.LINGER, 0)
        self._input.bind(input_addr)
        self._output = self._ctx.socket(zmq.PULL)
        self._output.setsockopt(zmq.LINGER, 0)
        self._output.bind(output_addr)
        self.proc = mp.Process(
            target=target,
            args=(dataclasses.asdict(engine_args), input_addr, output_addr, os.getpid()),
            name="pagedllm-engine-core",
            # A daemonic process may not start processes: with several ranks the core starts a worker per
            # rank, and notices a vanished front-end through the parent pid it is given instead.
            daemon=engine_args.tensor_parallel_size * engine_args.pipeline_parallel_size == 1,
        )
        # A signal inside start() can land after the spawn but before the Process records its child, which
        # shutdown() would then not see: SIGTERM and SIGINT wait until start() returns (the child, which
        # inherits the mask, clears it first thing in run_engine_core).
        held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
        try:
            self.proc.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)

    def wait_ready(self, timeout_s: float = 900.0) -> None:
        """Blocks until the core has built its engine; raises RuntimeError (and shuts the process
        down) if it failed or exited. Separate from __init__ so the caller can work meanwhile."""
        try:
            deadline = time.monotonic() + timeout_s
            while not self.poll_ready(_STARTUP_POLL_MS):
                if time.monotonic() >= deadline:
                    raise RuntimeError(f"engine core did not become ready within {timeout_s:.0f} s")
        except BaseException:
            self.shutdown()
            raise

    def poll_ready(self, wait_ms: int) -> bool:
        """Waits up to ``wait_ms`` for the core's start-up to end: True once it is ready (``num_blocks`` set),
        False while it is still starting; RuntimeError if it failed or exited."""
        if self._output.poll(wait_ms):
            msg = self._decoder.decode(self._output.recv())
            if isinstance(msg, m.Ready):
                logger.info("engine core ready in process %d with %d KV blocks", msg.pid, msg.num_blocks)
                self.num_blocks = msg.num_blocks
                return True
            if isinstance(msg, m.EngineDead):
                raise RuntimeError(msg.message)
            return False
        if not self.proc.is_alive():
            raise RuntimeError(f"engine core process exited during start-up (exit code {self.proc.exitcode})")
        return False

    # ---- liveness ----------------------------------------------------------------------------------
    @property
    def is_dead(self) -> bool:
        return self.dead_error is not None

    def start_watch(self, loop: asyncio.AbstractEventLoop) -> None:
        """Watches the core process from `loop` (call once, from inside the running loop)."""
        if self._watching:
            return
        self._watching = True
        import zmq.asyncio

        self._async_output = zmq.asyncio.Socket.from_socket(self._output)
        loop.add_reader(self.proc.sentinel, self._on_process_exit, loop)

    def _on_process_exit(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.remove_reader(self.proc.sentinel)
        self.proc.join(0)
        if not self._closed:
            self.mark_dead(f"engine core process {self.proc.pid} exited unexpectedly (exit code {self.proc.exitcode})")

    def mark_dead(self, message: str) -> None:
        if self.dead_error is not None:
            return
        logger.error("engine is dead: %s", message)
        self.dead_error = message
        for fut in self._pending_calls.values():
            if not fut.done():
                fut.set_exception(EngineDeadError(message))
        self._pending_calls.clear()
        if self.on_dead is not None:
            self.on_dead(message)

    def check_alive(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(self.dead_error)

    # ---- inputs ------------------------------------------------------------------------------------
    def _send(self, msg: Any) -> None:
        self.check_alive()
        try:
            self._input.send(self._encoder.encode(msg), self._zmq.NOBLOCK)
        except self._zmq.Again:
            # Only possible when the core has dropped its connection: it is gone.
            self.mark_dead("engine core is not reading its input")
            raise EngineDeadError(self.dead_error) from None

    def add_request(self, req: Request) -> None:
        self._send(
            m.AddRequest(
                request_id=req.request_id,
                prompt_token_ids=req.prompt_token_ids,
                params=m.params_to_dict(req.sampling_params),
                seed=req.seed,
                eos_token_ids=sorted(req.eos_token_ids),
            )
        )

    def core_of(self, request_id: str) -> int:
        """The data-parallel core a request runs on: always 0 here (see DPCoreClient)."""
        return 0

    def abort(self, request_ids: list[str]) -> None:
        if request_ids and not self.is_dead:
            self._send(m.Abort(list(request_ids)))

    def finish_by_stop_string(self, request_id: str, stop: str) -> None:
        if not self.is_dead:
            self._send(m.FinishByStopString(request_id, stop))

    def wake(self) -> None:
        """Ends the core's wait for input (data-parallel cores in lockstep: another core got a request)."""
        if not self.is_dead:
            self._send(m.Wake())

    def request_shutdown(self) -> None:
        """Asks the core to stop without waiting for it (``shutdown`` then waits)."""
        if self._closed or self._shutdown_sent or self.proc is None or not self.proc.is_alive():
            return
        self._shutdown_sent = True
        try:
            self._input.send(self._encoder.encode(m.Shutdown()), self._zmq.NOBLOCK)
        except self._zmq.ZMQError:
            pass

    def kill(self) -> None:
        """Ends the core process at once (it ignores SIGTERM while serving); ``shutdown`` still cleans up."""
        if self.proc is not None and self.proc.is_alive():
            self.proc.kill()

    async def call_utility(self, method: str, *args: Any) -> Any:
        call_id = next(self._call_ids)
        fut = asyncio.get_running_loop().create_future()
        self._pending_calls[call_id] = fut
        try:
            self._send(m.UtilityCall(call_id, method, list(args)))
        except BaseException:
            self._pending_calls.pop(call_id, None)
            raise
        return await fut

    # ---- outputs -----------------------------------------------------------------------------------
    async def recv(self) -> m.CoreOutputs | m.EngineDead | None:
        """The next CoreOutputs (or EngineDead); utility results are resolved here, returning None."""
        raw = await self._async_output.recv(copy=False)
        msg = self._decoder.decode(raw.buffer)
        if isinstance(msg, m.UtilityResult):
            fut = self._pending_calls.pop(msg.call_id, None)
            if fut is not None and not fut.done():
                if msg.error is not None:
                    fut.set_exception(RuntimeError(msg.error))
                else:
                    fut.set_result(msg.result)
            return None
        if isinstance(msg, m.EngineDead):
            self.mark_dead(msg.message)
        return msg

    async def recv_indexed(self) -> tuple[int, m.CoreOutputs | m.EngineDead]:
        """(0, the next CoreOutputs or EngineDead): the one-core form of DPCoreClient.recv_indexed."""
        while True:
            msg = await self.recv()
            if msg is not None:
                return 0, msg

    # ---- shutdown ----------------------------------------------------------------------------------
    def shutdown(self, timeout_s: float = 5.0) -> None:
        if self._closed:
            return
        if self.proc is not None and self.proc.is_alive():
            self.request_shutdown()
            self._closed = True
            self.proc.join(timeout_s)
            if self.proc.is_alive():
                self.proc.terminate()
                self.proc.join(timeout_s)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join()
        self._closed = True
        for sock in (self._input, self._async_output, self._output):
            if sock is not None:
                sock.close()
        if self._ctx is not None:
            self._ctx.term()
        shutil.rmtree(self._tmpdir, ignore_errors=True)
