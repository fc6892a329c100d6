"""MultiprocExecutor (``mp``): one spawned worker process per rank on this host, fed msgpack over pipes.

Every step goes to every worker as plain data (executor/messages.py); every worker answers, and only the
sampling rank (the first tensor rank of the last pipeline stage) with the step's output. Its sampled
tokens ride on the next step's message to the other ranks, which append them to their request states.
The ranks meet over torch.distributed (gloo on CPUs, NCCL on GPUs) at a TCP port on 127.0.0.1.

A worker that raises reports the exception and exits; one that dies is seen through its process
sentinel. Either way the executor stops every worker and raises ``WorkerFailedError`` naming the rank,
now and on every later call, so the engine fails instead of waiting on a collective that never ends.
Workers exit on their own when the engine's process goes away.
"""
from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import queue
import signal
import socket
import sys
import threading
import time
import traceback
import weakref

from pagedllm.config import EngineConfig
from pagedllm.executor import messages as m
from pagedllm.executor.rank_executor import RankExecutor
from pagedllm.executor.rank_worker import RankWorker, WorkerFailedError  # noqa: F401 - callers catch it from here

logger = logging.getLogger("pagedllm")

# How long a worker may take to load its shard and join the others.
_START_TIMEOUT_S = 600.0
# How long shutdown waits for a worker to leave before it is terminated, then killed.
_JOIN_TIMEOUT_S = 5.0
# How often a worker checks that the engine's process is still there.
_PARENT_POLL_S = 0.5


def _free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop_processes(procs: list[multiprocessing.process.BaseProcess], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(1.0)
        if p.is_alive():
            p.kill()
            p.join(1.0)


class MultiprocExecutor(RankExecutor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self._encoder = m.msgspec.msgpack.Encoder()
        self._decoder = m.output_decoder()
        ctx = multiprocessing.get_context("spawn")
        init_method = f"tcp://127.0.0.1:{_free_loopback_port()}"
        self.procs: list[multiprocessing.process.BaseProcess] = []
        self.conns: list[multiprocessing.connection.Connection] = []
        for rank in range(self.world_size):
            parent_end, child_end = ctx.Pipe(duplex=True)
            proc = ctx.Process(target=run_worker, args=(config, rank, init_method, child_end, os.getpid()),
                               name=f"pagedllm-worker-{rank}", daemon=True)
            proc.start()
            child_end.close()
            self.procs.append(proc)
            self.conns.append(parent_end)
        # Workers go when this object does, even without shutdown().
        self._finalizer = weakref.finalize(self, _stop_processes, self.procs, 0.0)
        try:
            ready = self._collect(_START_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise
        logger.info("%d workers ready (pids %s)", self.world_size, ", ".join(str(r.pid) for r in ready))

    # ---- messages ----------------------------------------------------------------------------------
    def _send(self, msg) -> None:
        """The answers come back on the pipes in the order the messages went: no handle needed."""
        self._broadcast(msg)

    def _answers(self, handle) -> list:
        return self._collect()

    def _broadcast(self, msg) -> None:
        self._raise_if_failed()
        data = self._encoder.encode(msg)
        for rank, conn in enumerate(self.conns):
            try:
                conn.send_bytes(data)
            except OSError:
                self._fail(rank, self._death(rank))

    def _collect(self, timeout_s: float | None = None) -> list:
        """One answer from every worker, in rank order; fails the executor on a failure or a death."""
        answers: dict[int, object] = {}
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while len(answers) < self.world_size:
            pending = [r for r in range(self.world_size) if r not in answers]
            waitables = [self.conns[r] for r in pending] + [self.procs[r].sentinel for r in pending]
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = multiprocessing.connection.wait(waitables, left)
            if not ready:
                self._fail(pending[0], f"no answer within {timeout_s:.0f} s")
            for r in pending:
                if self.conns[r] in ready:
                    try:
                        msg = self._decoder.decode(self.conns[r].recv_bytes())
                    except (EOFError, OSError):
                        self._fail(r, self._death(r))
                    if isinstance(msg, m.Failed):
                        self._fail(r, msg.summary)
                    answers[r] = msg
                elif self.procs[r].sentinel in ready:
                    self._fail(r, self._death(r))
        return [answers[r] for r in range(self.world_size)]

    def _death(self, rank: int) -> str:
        proc = self.procs[rank]
        proc.join(0.5)
        code = proc.exitcode
        if code is not None and code < 0:
            try:
                how = f"killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"killed by signal {-code}"
        else:
            how = f"exited with code {code}"
        return f"process {proc.pid} {how}"

    def _stop_ranks(self) -> None:
        _stop_processes(self.procs, 0.0)

    # ---- the Executor interface ---------------------------------------------------------------------
    def check_health(self) -> None:
        self._raise_if_failed()
        for rank, proc in enumerate(self.procs):
            if not proc.is_alive():
                self._fail(rank, self._death(rank))

    def shutdown(self) -> None:
        if self._failed is None:
            data = self._encoder.encode(m.Shutdown())
            for conn in self.conns:
                try:
                    conn.send_bytes(data)
                except OSError:
                    pass
        _stop_processes(self.procs, _JOIN_TIMEOUT_S)
        for conn in self.conns:
            conn.close()
        self._finalizer.detach()


# ---- the worker process ------------------------------------------------------------------------------


def _exit_when_orphaned(parent_pid: int) -> None:
    while True:
        time.sleep(_PARENT_POLL_S)
        if os.getppid() != parent_pid:
            os._exit(1)


def _read_messages(conn, inbox: queue.SimpleQueue) -> None:
    while True:
        try:
            inbox.put(conn.recv_bytes())
        except (EOFError, OSError):
            inbox.put(None)
            return


def run_worker(config: EngineConfig, rank: int, init_method: str, conn, parent_pid: int) -> None:
    """Process entry point: join the ranks, load this rank's shard, then answer messages until Shutdown."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine's process owns shutdown
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s %(asctime)s rank {rank}: %(message)s",
                        datefmt="%H:%M:%S")
    threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), daemon=True).start()
    # On one host the rank is also the GPU index.
    body = RankWorker(config, rank, local_rank=rank)
    # Messages are read as they come, even while a step runs: with several steps in flight the executor
    # sends the next one before it reads this one's answer, and a large message and a large answer would
    # otherwise each wait for the other's pipe to drain.
    inbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
    try:
        conn.send_bytes(body.start(init_method))
        threading.Thread(target=_read_messages, args=(conn, inbox), daemon=True).start()
        while True:
            data = inbox.get()
            if data is None:
                break  # the executor is gone
            answer = body.handle(data)
            if answer is None:
                break
            conn.send_bytes(answer)
    except BaseException as e:  # noqa: BLE001 - reported to the executor, then the process ends
        try:
            conn.send_bytes(body.failed(e))
        except Exception:  # noqa: BLE001 - the executor still sees the process exit
            pass
        logger.error("worker failed:\n%s", traceback.format_exc())
        sys.stderr.flush()
        os._exit(1)
    os._exit(0)
