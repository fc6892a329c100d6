"""The engine-core process: builds an EngineCore and runs its busy loop behind two ZMQ sockets.

Loop: drain every queued input message (add / abort / stop-string / utility), run one step when
there is work, send the step's EngineCoreOutputs with fresh SchedulerStats. With nothing to do it
blocks on the input socket (waking now and then to check that its parent is still alive). Any
exception ends the process after an EngineDead message, so the front-end can fail requests at once.

Data parallelism with expert parallelism: the K cores' ranks share every MoE layer's experts, so the cores
step in lockstep (``_LockstepLoop``). Each iteration every core drains its inputs, then all agree over the
lockstep group whether any has work; if one has, every core makes exactly one model call (its own step, or
an empty one that only meets the others in the MoE layers), else every core waits for input. The front-end
wakes every core whenever it sends one a request, so that they all come back to the agreement.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import time
import traceback
from typing import Any

logger = logging.getLogger("pagedllm")

# Utility calls the front-end may make; anything else is answered with an error, never executed.
UTILITY_METHODS = ("stats", "reset_prefix_cache", "ping")
# Idle wake-up period (ms) to notice an orphaned core whose front-end was killed.
_IDLE_POLL_MS = 500
# oneDNN's and ideep's per-shape primitive caches in the engine-core process (see run_engine_core).
_PRIMITIVE_CACHE_CAPACITY = 64
# Never wait longer than this for the device, whatever a step's measured duration says.
_MAX_JIT_WAIT_S = 0.05


def run_engine_core(engine_args: dict[str, Any], input_addr: str, output_addr: str, parent_pid: int) -> None:
    """Process entry point (multiprocessing spawn target). Arguments are plain data only."""
    # Ctrl-C reaches the whole process group; the front-end owns shutdown and tells us (or we
    # notice it has gone), so the core must not die half-way through a step on SIGINT. SIGTERM ends
    # a start-up (the front-end's own fallback, too) but is ignored once serving (below).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})  # held by the parent's start()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s core: %(message)s", datefmt="%H:%M:%S")
    # On the CPU, oneDNN and torch's ideep layer keep a primitive per product shape, 1,024 of each by
    # default: a server meets a new shape with every new prompt-chunk length or batch size, and the cache
    # took hundreds of MiB over thousands of requests. At 64 the core's RSS stays flat after warm-up, at
    # the same request rate (docs/performance.md, "Serving soak"). Read at their first use; users may set them.
    for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        os.environ.setdefault(name, str(_PRIMITIVE_CACHE_CAPACITY))
    import zmq

    from pagedllm.engine import core_messages as m

    ctx = zmq.Context()
    inp = ctx.socket(zmq.PULL)
    inp.connect(input_addr)
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.SNDHWM, 0)  # never block the step loop on a slow reader
    out.setsockopt(zmq.LINGER, 5000)
    out.connect(output_addr)
    encoder = m.output_encoder()
    core = None
    try:
        core = _build_core(engine_args)
        # A data-parallel core in lockstep meets the other cores here, before it reports ready.
        loop = (_LockstepLoop if core.lockstep else _BusyLoop)(core, inp, out, parent_pid)
    except BaseException as e:  # noqa: BLE001 - report any start-up failure, then exit
        out.send(encoder.encode(m.EngineDead(f"engine core failed to start: {type(e).__name__}: {e}")))
        logger.error("engine core failed to start:\n%s", traceback.format_exc())
        if core is not None:
            core.shutdown()
        _close(ctx, inp, out)
        sys.exit(1)
    # From here the front-end owns shutdown: a SIGTERM sent to the whole process group (systemd's way)
    # must not end the core while the server drains its requests; the front-end's Shutdown message, or
    # its absence noticed through the parent pid, ends the loop.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    out.send(encoder.encode(m.Ready(num_blocks=core.num_blocks, pid=os.getpid())))
    try:
        loop.run()
    except SystemExit:
        pass
    except BaseException as e:  # noqa: BLE001
        logger.error("engine core died:\n%s", traceback.format_exc())
        try:
            out.send(encoder.encode(m.EngineDead(f"engine core died: {type(e).__name__}: {e}")))
        except Exception:  # noqa: BLE001 - the front-end will still see the process exit
            pass
        _close(ctx, inp, out)
        os._exit(1)
    finally:
        core.shutdown()
    _close(ctx, inp, out)


def _build_core(engine_args: dict[str, Any]):
    from pagedllm.engine.engine_core import EngineCore
    from pagedllm.engine_args import EngineArgs
    from pagedllm.executor.selector import make_executor

    config = EngineArgs(**engine_args).create_engine_config()
    return EngineCore(config, make_executor(config))


def _close(ctx, *socks) -> None:
    for s in socks:
        s.close()
    ctx.term()


class _BusyLoop:
    def __init__(self, core, inp, out, parent_pid: int) -> None:
        import zmq

        from pagedllm.engine import core_messages as m

        self.zmq = zmq
        self.m = m
        self.core = core
        self.inp = inp
        self.out = out
        self.parent_pid = parent_pid
        self.decoder = m.input_decoder()
        self.encoder = m.output_encoder()
        # Requests not yet scheduled, watched so their queue time can be reported once; then requests
        # scheduled but without a token yet, watched for their prefill time.
        self.unscheduled: dict[str, Any] = {}
        self.prefilling: dict[str, Any] = {}
        self.running = True
        # Outputs go out from inside the step, before its sampling launches (EngineCore.emit_outputs).
        self.sent_in_step = False
        core.emit_outputs = self._emit

    def _emit(self, outputs) -> None:
        self._send_outputs(outputs)
        self.sent_in_step = True

    def run(self) -> None:
        zmq = self.zmq
        while self.running:
            # A re-parented core means the front-end died without saying so (e.g. SIGKILL): stop,
            # rather than computing for nobody. One getppid() per step costs nothing.
            if os.getppid() != self.parent_pid:
                logger.warning("front-end process %d is gone; engine core exits", self.parent_pid)
                return
            busy = self.core.has_unfinished_requests()
            if not busy and not self.inp.poll(_IDLE_POLL_MS, zmq.POLLIN):
                self.core.executor.check_health()  # an idle engine must notice a dead worker too
                continue
            delay = self.core.submit_delay_s()
            if delay > 0:
                # Just-in-time submission: let the device get near the end of its step; requests that
                # arrive meanwhile are taken in below and join the next step.
                time.sleep(min(delay, _MAX_JIT_WAIT_S))
            handled = self._drain_inputs()
            self.sent_in_step = False
            outputs = self.core.step() if self.core.has_unfinished_requests() else []
            if not self.sent_in_step and (outputs or handled or busy):
                self._send_outputs(outputs)

    def _drain_inputs(self) -> bool:
        """Handles every queued message; whether any was more than a wake-up."""
        handled = False
        while True:
            try:
                raw = self.inp.recv(self.zmq.NOBLOCK, copy=False)
            except self.zmq.Again:
                return handled
            msg = self.decoder.decode(raw.buffer)
            try:
                self._handle(msg)
            except Exception as e:  # noqa: BLE001 - one bad message must not end the loop for everyone
                logger.exception("engine core could not handle %s", type(msg).__name__)
                self._reject(msg, e)
            handled = handled or not isinstance(msg, self.m.Wake)

    def _handle(self, msg) -> None:
        m = self.m
        if isinstance(msg, m.AddRequest):
            from pagedllm.core.request import Request

            params = m.params_from_dict(msg.params)
            req = Request(msg.request_id, msg.prompt_token_ids, params, msg.seed, eos_token_ids=frozenset(msg.eos_token_ids))
            self.core.add_request(req)
            self.unscheduled[req.request_id] = req
        elif isinstance(msg, m.Abort):
            self.core.abort_requests(msg.request_ids)
            for rid in msg.request_ids:
                self.unscheduled.pop(rid, None)
                self.prefilling.pop(rid, None)
        elif isinstance(msg, m.FinishByStopString):
            self.core.finish_by_stop_string(msg.request_id, msg.stop)
        elif isinstance(msg, m.UtilityCall):
            self.out.send(self.encoder.encode(self._utility(msg)))
        elif isinstance(msg, m.Shutdown):
            self.running = False
        # m.Wake: nothing to do; receiving it ended the wait for input (see _LockstepLoop).

    def _reject(self, msg, error: Exception) -> None:
        """Ends a request the core could not take in with an error output; a live id is left alone."""
        m = self.m
        if isinstance(msg, m.AddRequest) and msg.request_id not in self.core.scheduler.requests:
            from pagedllm.core.scheduler_output import EngineCoreOutput

            reason = f"the engine could not accept the request ({type(error).__name__})"
            self._send_outputs([EngineCoreOutput(msg.request_id, [], finish_reason="error", stop_reason=reason)])

    def _utility(self, msg):
        m = self.m
        if msg.method not in UTILITY_METHODS:
            return m.UtilityResult(msg.call_id, error=f"unknown utility method {msg.method!r}")
        try:
            if msg.method == "stats":
                result = self.core.stats()
            elif msg.method == "reset_prefix_cache":
                result = self.core.reset_prefix_cache()
            else:
                result = "pong"
        except Exception as e:  # noqa: BLE001 - a failed utility call is the caller's error
            return m.UtilityResult(msg.call_id, error=f"{type(e).__name__}: {e}")
        return m.UtilityResult(msg.call_id, result=result)

    def _send_outputs(self, outputs) -> None:
        queue_times, prefill_times = {}, {}
        if self.unscheduled:
            for rid, req in list(self.unscheduled.items()):
                if req.first_scheduled_time is not None:
                    queue_times[rid] = max(0.0, req.first_scheduled_time - req.arrival_time)
                    del self.unscheduled[rid]
                    self.prefilling[rid] = req
                elif req.is_finished:
                    del self.unscheduled[rid]
        if self.prefilling:
            now = time.monotonic()
            for rid, req in list(self.prefilling.items()):
                if req.num_output_tokens:
                    # First scheduled to first token on the host: the wait for steps already on the
                    # device, the prompt's steps, and the sampled token's way back.
                    prefill_times[rid] = max(0.0, now - req.first_scheduled_time)
                    del self.prefilling[rid]
                elif req.is_finished:
                    del self.prefilling[rid]
        msg = self.m.CoreOutputs(
            outputs=outputs, stats=self.core.stats(), queue_times=queue_times, prefill_times=prefill_times
        )
        self.out.send(self.encoder.encode(msg))


# How long a core waits in the lockstep group for the others: at most one step of theirs while it is busy,
# and one idle poll while it is idle. A core that dies closes its connections, which the others see at once.
_LOCKSTEP_TIMEOUT_S = 600.0


class _LockstepLoop(_BusyLoop):
    """The busy loop of a data-parallel core whose ranks share the MoE layers' experts with the other cores'.

    Every iteration is one agreement over the lockstep group and, when any core has work, one model call
    here; synchronous steps only (the config refuses asynchronous scheduling), so the step's outputs are
    known when it returns. A Shutdown also goes through the agreement, so every core leaves in the same
    iteration instead of waiting for one that has gone.
    """

    def __init__(self, core, inp, out, parent_pid: int) -> None:
        super().__init__(core, inp, out, parent_pid)
        from pagedllm.distributed.lockstep import LockstepGroup

        pc = core.config.parallel_config
        self.group = LockstepGroup(pc.data_parallel_sync_method, pc.data_parallel_rank, pc.data_parallel_size,
                                   _LOCKSTEP_TIMEOUT_S)

    def run(self) -> None:
        zmq = self.zmq
        while True:
            if os.getppid() != self.parent_pid:
                logger.warning("front-end process %d is gone; engine core exits", self.parent_pid)
                return
            handled = self._drain_inputs()
            busy = self.core.has_unfinished_requests()
            any_work, stop = self.group.agree(busy, not self.running)
            if stop:
                return
            if not any_work:
                if handled:
                    self._send_outputs([])  # fresh stats after an abort
                if not self.inp.poll(_IDLE_POLL_MS, zmq.POLLIN):
                    self.core.executor.check_health()
                continue
            self.sent_in_step = False
            outputs = self.core.step_lockstep()
            if not self.sent_in_step and (outputs or handled or busy):
                self._send_outputs(outputs)