"""AsyncLLM: the asyncio engine behind the server; the engine core runs in its own process.

The front-end process keeps the Processor (tokenization, validation, n > 1 fan-out) and the
OutputProcessor (detokenization, stop strings, logprobs), so HTTP and text work never stall the core
loop. One background task reads core outputs, turns them into DELTA RequestOutputs and routes them to
per-request queues; `generate` drains its queue. Leaving `generate` early for any reason (client
disconnect, cancellation, error) aborts the request in the core at once, which frees its KV blocks.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from pagedllm.core.scheduler import SchedulerStats
from pagedllm.engine.core_client import CoreClient, EngineDeadError
from pagedllm.engine.dp_client import DPCoreClient, sum_stats
from pagedllm.engine.heap import freeze_start_up_heap, unfreeze_heap
from pagedllm.engine.output_processor import OutputKind, OutputProcessor
from pagedllm.engine.processor import Processor, PromptType
from pagedllm.engine_args import EngineArgs
from pagedllm.model_loader.tokenizer import get_tokenizer
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger("pagedllm")

# Core outputs handled between two yields to the event loop, so a big batch doesn't starve HTTP.
_OUTPUT_SLICE = 64

__all__ = ["AsyncLLM", "EngineDeadError", "RequestAbortedError", "RequestFailedError", "RequestStream"]


class RequestAbortedError(RuntimeError):
    """The request was aborted through AsyncLLM.abort while someone was reading it."""


class RequestFailedError(RuntimeError):
    """The engine ended this request alone with an error (its step or its sampling failed); the engine
    and every other request go on."""


@dataclass
class _ParentTimes:
    arrival: float
    num_prompt_tokens: int
    first_token: float | None = None


@dataclass
class _ChildTimes:
    parent_id: str
    parent: _ParentTimes
    last_token: float | None = None


def make_core_client(engine_args: EngineArgs) -> CoreClient | DPCoreClient:
    """One engine-core process, or data_parallel_size of them behind a router."""
    if engine_args.data_parallel_size > 1:
        engine_args._parallel_config().check()  # names a bad size before K processes start
        if engine_args.enable_expert_parallel:
            # The model's shapes against dp x tp expert-parallel ranks too (cores in lockstep meet at start-up).
            engine_args.create_engine_config()
        return DPCoreClient(engine_args)
    return CoreClient(engine_args)


class AsyncLLM:
    def __init__(self, engine_args: EngineArgs, startup_timeout_s: float = 900.0) -> None:
        self.engine_args = engine_args
        # Start the core first: its imports and model load overlap with the front-end's own set-up.
        self.core = make_core_client(engine_args)
        try:
            self.config = engine_args.create_engine_config()
            self.model_config = self.config.model_config
            self.tokenizer = get_tokenizer(self.model_config)
            self.processor = Processor(self.model_config, self.tokenizer)
            self.output_processor = OutputProcessor(self.tokenizer)
        except BaseException:
            self.core.shutdown()
            raise
        self.stat_loggers: list[Any] = []
        self._queues: dict[str, asyncio.Queue] = {}
        self._children: dict[str, _ChildTimes] = {}
        # Accepted requests that have produced no output yet (queued or prefilling): admission control.
        self._unstarted: set[str] = set()
        self._output_task: asyncio.Task | None = None
        self._dead_callbacks: list[Callable[[str], None]] = []
        self.latest_stats = SchedulerStats()  # all data-parallel cores together
        self._core_stats: dict[int, SchedulerStats] = {}
        self.core.wait_ready(startup_timeout_s)
        self.core.on_dead = self._on_dead
        freeze_start_up_heap()  # the front-end's full collections would stall its event loop (heap.py)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, **kwargs: Any) -> AsyncLLM:
        return cls(engine_args, **kwargs)

    # ---- state -------------------------------------------------------------------------------------
    @property
    def is_dead(self) -> bool:
        return self.core.is_dead

    @property
    def dead_error(self) -> str | None:
        return self.core.dead_error

    @property
    def num_unstarted_requests(self) -> int:
        return len(self._unstarted)

    @property
    def num_active_requests(self) -> int:
        return len(self._queues)

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def add_stat_logger(self, stat_logger: Any) -> None:
        self.stat_loggers.append(stat_logger)

    def add_dead_callback(self, callback: Callable[[str], None]) -> None:
        """`callback(message)` runs once, from the event loop, when the engine core dies (after every
        request in flight has been handed its EngineDeadError)."""
        self._dead_callbacks.append(callback)

    def start(self) -> None:
        """Starts the output task and the core-process watch; needs a running loop. Idempotent."""
        if self._output_task is None:
            loop = asyncio.get_running_loop()
            self.core.start_watch(loop)
            self._output_task = loop.create_task(self._output_loop(), name="pagedllm-output-loop")

    # ---- requests ----------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: PromptType, sampling_params: SamplingParams) -> RequestStream:
        """Validates and queues a request; raises ValueError (nothing queued) for an invalid one and
        EngineDeadError once the engine has died. The caller must iterate or close the stream."""
        self.start()
        self.core.check_alive()
        if request_id in self._queues:
            raise ValueError(f"request_id {request_id!r} is already in use")
        processed = self.processor.process(request_id, prompt, sampling_params)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        self.output_processor.add_request(processed, OutputKind.DELTA)
        times = _ParentTimes(time.monotonic(), len(processed.prompt_token_ids))
        for child in processed.children:
            self._children[child.request_id] = _ChildTimes(request_id, times)
        self._unstarted.add(request_id)
        stream = RequestStream(self, request_id, queue)
        try:
            for child in processed.children:
                self.core.add_request(child)
        except BaseException:
            stream.close()
            raise
        return stream

    async def generate(
        self, prompt: PromptType, sampling_params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """DELTA RequestOutputs of one request until it finishes. Raises ValueError for an invalid
        request (before anything is queued) and EngineDeadError if the engine dies."""
        stream = self.add_request(request_id, prompt, sampling_params)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    async def abort(self, request_id: str) -> None:
        queue = self._queues.pop(request_id, None)
        self._abort_now(request_id)
        if queue is not None:
            queue.put_nowait(RequestAbortedError(f"request {request_id} was aborted"))

    def _abort_now(self, request_id: str) -> None:
        """Forgets a request and tells the core to drop it (and free its blocks). Never awaits, so
        it is safe from finally blocks of cancelled tasks."""
        self._queues.pop(request_id, None)
        self._unstarted.discard(request_id)
        children = self.output_processor.abort_requests([request_id])
        now = time.monotonic()
        for cid in children:
            ct = self._children.pop(cid, None)
            if ct is not None:
                self._record("record_finished", "abort", now - ct.parent.arrival, engine=self.core.core_of(cid))
        if children and not self.core.is_dead:
            try:
                self.core.abort(children)
            except EngineDeadError:
                pass  # a dead core holds no blocks any more; callers are told through their queues

    # ---- utilities ---------------------------------------------------------------------------------
    async def get_stats(self) -> SchedulerStats:
        """A fresh snapshot from the core (the metrics use the one that comes with every step)."""
        self.start()
        d = await self.core.call_utility("stats")
        return SchedulerStats(**d) if isinstance(d, dict) else d

    async def reset_prefix_cache(self) -> bool:
        self.start()
        return bool(await self.core.call_utility("reset_prefix_cache"))

    async def check_health(self) -> None:
        self.core.check_alive()

    # ---- the output task ---------------------------------------------------------------------------
    async def _output_loop(self) -> None:
        from pagedllm.engine.core_messages import CoreOutputs

        try:
            while not self.core.is_dead:
                engine, msg = await self.core.recv_indexed()
                if isinstance(msg, CoreOutputs):
                    outs = msg.outputs
                    for start in range(0, max(len(outs), 1), _OUTPUT_SLICE):
                        if start:
                            await asyncio.sleep(0)
                        self._handle_outputs(outs[start : start + _OUTPUT_SLICE], engine)
                    for seconds in msg.queue_times.values():
                        self._record("record_queue_time", seconds, engine=engine)
                    for seconds in msg.prefill_times.values():
                        self._record("record_prefill_time", seconds, engine=engine)
                    self._core_stats[engine] = msg.stats
                    self.latest_stats = sum_stats(list(self._core_stats.values()))
                    self._record("record_scheduler_stats", msg.stats, engine=engine)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a broken output path leaves the engine unusable
            logger.exception("output processing failed")
            self.core.mark_dead(f"output processing failed: {type(e).__name__}: {e}")

    def _handle_outputs(self, outputs: list, engine: int = 0) -> None:
        now = time.monotonic()
        for out in outputs:
            ct = self._children.get(out.req_id)
            if ct is None:
                continue
            n = len(out.new_token_ids)
            if n:
                if ct.parent.first_token is None:
                    ct.parent.first_token = now
                    self._record("record_prompt_tokens", ct.parent.num_prompt_tokens, engine=engine)
                    self._record("record_first_token", now - ct.parent.arrival, engine=engine)
                if ct.last_token is not None:
                    self._record("record_inter_token", now - ct.last_token, engine=engine)
                ct.last_token = now
                self._record("record_generation_tokens", n, engine=engine)
            if out.finished:
                del self._children[out.req_id]
                self._record("record_finished", out.finish_reason, now - ct.parent.arrival, engine=engine)
        request_outputs, stops = self.output_processor.process_outputs(outputs)
        for child_id, stop in stops:
            ct = self._children.pop(child_id, None)
            if ct is not None:
                self._record("record_finished", "stop", now - ct.parent.arrival, engine=engine)
            self.core.finish_by_stop_string(child_id, stop)
        for ro in request_outputs:
            self._unstarted.discard(ro.request_id)
            queue = self._queues.get(ro.request_id)
            if queue is not None:
                queue.put_nowait(ro)

    def _record(self, hook: str, *args: Any, engine: int = 0) -> None:
        for sl in self.stat_loggers:
            try:
                getattr(sl, hook)(*args, engine=engine)
            except Exception:  # noqa: BLE001 - metrics must never break serving
                logger.exception("stat logger %s.%s failed", type(sl).__name__, hook)

    def _on_dead(self, message: str) -> None:
        err = EngineDeadError(message)
        for queue in self._queues.values():
            queue.put_nowait(err)
        self._unstarted.clear()
        task = self._output_task
        if task is not None and task is not asyncio.current_task() and not task.done():
            task.cancel()
        for callback in self._dead_callbacks:
            try:
                callback(message)
            except Exception:  # noqa: BLE001 - every callback must run; the engine is gone anyway
                logger.exception("engine-death callback %r failed", callback)

    # ---- shutdown ----------------------------------------------------------------------------------
    def shutdown(self) -> None:
        if self._output_task is not None and not self._output_task.done():
            self._output_task.cancel()
        self.core.shutdown()
        unfreeze_heap()


class RequestStream:
    """The DELTA outputs of one request. Closing it before the last output aborts the request;
    a cancelled reader should close it in a finally block (close() never awaits)."""

    def __init__(self, engine: AsyncLLM, request_id: str, queue: asyncio.Queue) -> None:
        self.engine = engine
        self.request_id = request_id
        self._queue = queue
        self.finished = False
        self._closed = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished or self._closed:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.close()
            raise item
        failed = next((c for c in item.outputs if c.finish_reason == "error"), None)
        if failed is not None:
            self.close()  # aborts its siblings, if any are still running
            raise RequestFailedError(str(failed.stop_reason))
        if item.finished:
            self.finished = True
            self.engine._queues.pop(self.request_id, None)
        return item

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self.finished:
            self.engine._abort_now(self.request_id)
