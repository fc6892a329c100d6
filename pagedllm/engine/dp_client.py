"""DPCoreClient: K engine-core processes (data parallelism) behind the CoreClient interface.

Each core is an ordinary CoreClient with data_parallel_size 1 and its own TP x PP group; on GPUs core
i sees devices [i*tp*pp, (i+1)*tp*pp) of the front-end's (CUDA_VISIBLE_DEVICES at spawn). A DPRouter
picks the core of each new request; aborts and stop-string finishes go to the owning core; outputs
of all cores are merged into one stream tagged with the core index. A core that dies kills the whole
engine: every request in flight on any core fails with an error naming the core.

With expert parallelism the cores' ranks share every MoE layer's experts: each core is told its index and
two loopback addresses (where the model ranks of all cores meet as one world, and where the cores meet for
their lockstep), every request sent to one core comes with a wake-up for the others, and the first core to
die takes the others down at once, since they cannot go on without it.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
import time
from typing import Any, Callable

from pagedllm.core.request import Request
from pagedllm.core.scheduler import SchedulerStats
from pagedllm.engine import core_messages as m
from pagedllm.engine.core_client import CoreClient, EngineDeadError
from pagedllm.engine.dp_router import DPRouter
from pagedllm.engine_args import EngineArgs

logger = logging.getLogger("pagedllm")

# Sync receive poll period (offline engine): how soon a silently dead core is noticed.
_SYNC_POLL_MS = 200
# Cores in lockstep: how long a survivor's report of a lost peer waits for that peer's own exit to show, so
# that the killed core is the one named (offline engine; the server's process watch sees exits at once).
_PEER_DEATH_GRACE_S = 1.0


def core_devices(engine_args: EngineArgs, core: int, visible: str | None) -> str:
    """The CUDA_VISIBLE_DEVICES value for data-parallel core `core` (its TP x PP ranks' devices)."""
    per_core = engine_args.tensor_parallel_size * engine_args.pipeline_parallel_size
    ids = [d.strip() for d in visible.split(",") if d.strip()] if visible else None
    wanted = range(core * per_core, (core + 1) * per_core)
    if ids is not None:
        if wanted.stop > len(ids):
            raise ValueError(
                f"data_parallel_size {engine_args.data_parallel_size} x {per_core} ranks per core needs "
                f"{engine_args.data_parallel_size * per_core} devices; CUDA_VISIBLE_DEVICES lists {len(ids)}"
            )
        return ",".join(ids[i] for i in wanted)
    return ",".join(str(i) for i in wanted)


def _free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def core_engine_args(engine_args: EngineArgs) -> list[EngineArgs]:
    """Each core's engine args: one core's own (data_parallel_size 1), or, with expert parallelism, the whole
    data-parallel size with the core's index and the addresses where all cores' ranks and the cores meet."""
    k = engine_args.data_parallel_size
    if not engine_args.enable_expert_parallel:
        return [dataclasses.replace(engine_args, data_parallel_size=1)] * k
    model_world = f"tcp://127.0.0.1:{_free_loopback_port()}"
    lockstep = f"tcp://127.0.0.1:{_free_loopback_port()}"
    return [dataclasses.replace(engine_args, data_parallel_rank=i, data_parallel_init_method=model_world,
                                data_parallel_sync_method=lockstep) for i in range(k)]


class DPCoreClient:
    def __init__(self, engine_args: EngineArgs) -> None:
        self.num_cores = engine_args.data_parallel_size
        # The cores step in lockstep (expert parallelism across them): see the module docstring.
        self.lockstep = engine_args.enable_expert_parallel and self.num_cores > 1
        self.router = DPRouter(self.num_cores, engine_args.block_size)
        self.cores: list[CoreClient] = []
        self.dead_error: str | None = None
        self.on_dead: Callable[[str], None] | None = None
        self.num_blocks = 0
        self._queue: asyncio.Queue | None = None
        self._readers: list[asyncio.Task] = []
        on_gpu = engine_args.device != "cpu"
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        try:
            for i, core_args in enumerate(core_engine_args(engine_args)):
                devices = core_devices(engine_args, i, visible) if on_gpu else None
                self.cores.append(self._spawn(core_args, devices))
        except BaseException:
            self.shutdown()
            raise

    @staticmethod
    def _spawn(core_args: EngineArgs, devices: str | None) -> CoreClient:
        # A spawned process copies os.environ when it starts: set the core's devices just for that.
        if devices is None:
            return CoreClient(core_args)
        saved = os.environ.get("CUDA_VISIBLE_DEVICES")
        os.environ["CUDA_VISIBLE_DEVICES"] = devices
        try:
            return CoreClient(core_args)
        finally:
            if saved is None:
                del os.environ["CUDA_VISIBLE_DEVICES"]
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = saved

    def wait_ready(self, timeout_s: float = 900.0) -> None:
        """Waits for every core at once: a core that fails to start is reported as soon as it does, even
        while another waits for it (cores in lockstep meet during start-up)."""
        deadline = time.monotonic() + timeout_s
        starting = list(range(self.num_cores))
        try:
            while starting:
                for i in list(starting):
                    try:
                        if self.cores[i].poll_ready(_SYNC_POLL_MS // len(starting)):
                            starting.remove(i)
                            self.cores[i].on_dead = self._core_dead_callback(i)
                    except RuntimeError as e:
                        raise RuntimeError(f"data-parallel engine core {i}: {e}") from e
                if starting and time.monotonic() >= deadline:
                    raise RuntimeError(f"data-parallel engine core {starting[0]}: engine core did not become ready "
                                       f"within {timeout_s:.0f} s")
        except BaseException:
            self.shutdown()
            raise
        self.num_blocks = min(c.num_blocks for c in self.cores)

    @property
    def pids(self) -> list[int]:
        return [c.proc.pid for c in self.cores]

    # ---- liveness ----------------------------------------------------------------------------------
    @property
    def is_dead(self) -> bool:
        return self.dead_error is not None

    def _core_dead_callback(self, i: int) -> Callable[[str], None]:
        return lambda message: self.mark_dead(self._cause(i, message))

    def _cause(self, i: int, message: str, grace_s: float = 0.0) -> str:
        """What to report when core ``i`` died with ``message``. Cores in lockstep fail together: a survivor
        reports the lost connection to a core that was killed (OOM, a signal), so such a core is named first,
        waiting up to ``grace_s`` for its exit to show."""
        text = f"data-parallel engine core {i}: {message}"
        deadline = time.monotonic() + grace_s
        while self.lockstep:
            for j, core in enumerate(self.cores):
                code = core.proc.exitcode if j != i and core.proc is not None else None
                if code is not None and code < 0:
                    return (f"data-parallel engine core {j}: process {core.proc.pid} was killed (signal {-code}); "
                            f"then {text}")
            if time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        return text

    def start_watch(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._queue is not None:
            return
        self._queue = asyncio.Queue()
        for i, core in enumerate(self.cores):
            core.start_watch(loop)
            self._readers.append(loop.create_task(self._read(i, core), name=f"pagedllm-dp-reader-{i}"))

    async def _read(self, i: int, core: CoreClient) -> None:
        try:
            while not core.is_dead:
                msg = await core.recv()
                if msg is not None:
                    self._queue.put_nowait((i, msg))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a broken socket is a dead core
            self.mark_dead(f"data-parallel engine core {i}: output stream failed: {type(e).__name__}: {e}")

    def mark_dead(self, message: str) -> None:
        if self.dead_error is not None:
            return
        logger.error("engine is dead: %s", message)
        self.dead_error = message
        for core in self.cores:
            core.mark_dead(message)  # the survivors take no more requests and fail their pending calls
            if self.lockstep:
                core.kill()  # it would wait for the dead core in its next collective
        if self._queue is not None:
            self._queue.put_nowait((-1, m.EngineDead(message)))
        if self.on_dead is not None:
            self.on_dead(message)

    def check_alive(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(self.dead_error)

    # ---- inputs ------------------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        self.check_alive()
        core = self.router.add(req.request_id, req.prompt_token_ids)
        try:
            self.cores[core].add_request(req)
        except BaseException:
            self.router.finished(req.request_id)
            raise
        if self.lockstep:
            # The others may be waiting for input; they must join the agreement that starts this request.
            for i, other in enumerate(self.cores):
                if i != core:
                    other.wake()

    def core_of(self, request_id: str) -> int:
        core = self.router.core_of(request_id)
        return 0 if core is None else core

    def abort(self, request_ids: list[str]) -> None:
        by_core: dict[int, list[str]] = {}
        for rid in request_ids:
            core = self.router.finished(rid)
            if core is not None:
                by_core.setdefault(core, []).append(rid)
        if self.is_dead:
            return
        for core, ids in by_core.items():
            self.cores[core].abort(ids)

    def finish_by_stop_string(self, request_id: str, stop: str) -> None:
        core = self.router.finished(request_id)
        if core is not None and not self.is_dead:
            self.cores[core].finish_by_stop_string(request_id, stop)

    def note_outputs(self, outputs: list) -> None:
        """Keeps the router's load counts true: first output -> started, finished -> gone."""
        for out in outputs:
            if out.finished:
                self.router.finished(out.req_id)
            elif out.new_token_ids:
                self.router.started(out.req_id)

    async def call_utility(self, method: str, *args: Any) -> Any:
        self.check_alive()
        results = await asyncio.gather(*(c.call_utility(method, *args) for c in self.cores))
        if method == "stats":
            return sum_stats([SchedulerStats(**r) if isinstance(r, dict) else r for r in results])
        if method == "reset_prefix_cache":
            return all(bool(r) for r in results)
        return results[0]

    # ---- outputs -----------------------------------------------------------------------------------
    async def recv_indexed(self) -> tuple[int, m.CoreOutputs | m.EngineDead]:
        """The next (core index, CoreOutputs) of any core, or (-1, EngineDead) once one has died."""
        i, msg = await self._queue.get()
        if isinstance(msg, m.EngineDead):
            self.mark_dead(msg.message if i < 0 else self._cause(i, msg.message))
            return -1, m.EngineDead(self.dead_error)
        self.note_outputs(msg.outputs)
        return i, msg

    def recv_sync(self) -> list[tuple[int, m.CoreOutputs]]:
        """Offline engine: blocks until at least one core has sent outputs; returns all that are ready.
        Raises EngineDeadError naming the core if one reported death or its process is gone."""
        import zmq

        poller = zmq.Poller()
        for core in self.cores:
            poller.register(core._output, zmq.POLLIN)
        got: list[tuple[int, m.CoreOutputs]] = []
        while not got:
            self.check_alive()
            ready = dict(poller.poll(_SYNC_POLL_MS))
            for i, core in enumerate(self.cores):
                if core._output in ready:
                    msg = core._decoder.decode(core._output.recv())
                    if isinstance(msg, m.EngineDead):
                        self.mark_dead(self._cause(i, msg.message, _PEER_DEATH_GRACE_S))
                    elif isinstance(msg, m.CoreOutputs):
                        self.note_outputs(msg.outputs)
                        got.append((i, msg))
                elif not core.proc.is_alive():
                    self.mark_dead(f"data-parallel engine core {i}: process {core.proc.pid} exited unexpectedly "
                                   f"(exit code {core.proc.exitcode})")
        return got

    # ---- shutdown ----------------------------------------------------------------------------------
    def shutdown(self, timeout_s: float = 5.0) -> None:
        for task in self._readers:
            if not task.done():
                task.cancel()
        for core in self.cores:
            # All at once: cores in lockstep leave together, in the iteration where the first one is asked.
            core.request_shutdown()
        for core in self.cores:
            core.shutdown(timeout_s)


def sum_stats(stats: list[SchedulerStats]) -> SchedulerStats:
    """All cores' stats as one engine's (KV usage: the mean, as every core has a cache of its own)."""
    return SchedulerStats(
        num_running_reqs=sum(s.num_running_reqs for s in stats),
        num_waiting_reqs=sum(s.num_waiting_reqs for s in stats),
        kv_cache_usage=sum(s.kv_cache_usage for s in stats) / max(len(stats), 1),
        num_preemptions=sum(s.num_preemptions for s in stats),
        prefix_cache_queries=sum(s.prefix_cache_queries for s in stats),
        prefix_cache_hits=sum(s.prefix_cache_hits for s in stats),
    )
