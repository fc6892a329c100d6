"""EngineCore: the scheduler and the executor in one loop; step() = schedule, execute, update."""
from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

from pagedllm.config import EngineConfig
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler, SchedulerStats
from pagedllm.core.scheduler_output import EngineCoreOutput, SchedulerOutput
from pagedllm.engine.heap import freeze_start_up_heap, unfreeze_heap
from pagedllm.structured_output.manager import StructuredOutputManager
from pagedllm.executor.base import Executor

logger = logging.getLogger("pagedllm")

# Just-in-time submission: the next step is scheduled this long plus twice the usual host time of
# scheduling it and queuing its forward pass before the device is expected to finish the current one.
_JIT_SAFETY_S = 0.0005
# Only decode batches up to this size wait. Light load is where the wait pays (a new request joins the
# very next step instead of the one after it); a large batch's host work is larger and more variable, a
# late submission there idles the whole batch, and its arrivals queue behind others anyway (on the
# H200, one 256-stream run lost 16% of throughput to it).
_JIT_MAX_BATCH = 32
# Weight of the newest sample in the running averages of device and host times.
_EMA = 0.3


class EngineCore:
    def __init__(self, config: EngineConfig, executor: Executor) -> None:
        self.config = config
        self.executor = executor
        num_blocks = executor.determine_num_blocks()
        self._check_cache_fits(num_blocks)
        executor.initialize_cache(num_blocks)
        self.num_blocks = num_blocks
        self.scheduler = Scheduler(config.scheduler_config, config.cache_config, num_blocks)
        self.async_scheduling = config.scheduler_config.async_scheduling
        # Asynchronous mode: the step submitted to the executor whose output has not been applied yet.
        self._in_flight: SchedulerOutput | None = None
        # Several batches in flight (pipeline parallelism): those submitted and not yet applied, oldest first.
        self.max_batches = config.scheduler_config.max_concurrent_batches
        self._batches: deque[SchedulerOutput] = deque()
        # Just-in-time submission (asynchronous mode): device seconds of a pure-decode step by batch size,
        # host seconds to schedule a step and queue its forward pass, and when the last step's output
        # arrived (which is when the device moved on to the step in flight).
        self._jit = self.async_scheduling and config.scheduler_config.submit_just_in_time
        self._decode_device_s: dict[int, float] = {}
        self._submit_host_s = 0.0
        # The step being scheduled and run by the current call of ``step``: with the step in flight, what a
        # failure ends.
        self._submitting: SchedulerOutput | None = None
        # (Asynchronous mode) Called with each step's outputs as soon as they are known, instead of
        # ``step`` returning them: the serving loop sends them on from here (core_proc.py).
        self.emit_outputs: Callable[[list[EngineCoreOutput]], None] | None = None
        self._output_at: float | None = None
        # Constrained requests wait there for their grammars; built (xgrammar imported) on the first one.
        self.structured = StructuredOutputManager(
            config.model_config, config.structured_outputs_config.reasoning_parser
        )
        # Data parallelism with expert parallelism: each step is exactly one model call (``step_lockstep``);
        # whether the current step made it.
        self.lockstep = config.parallel_config.dp_expert_parallel
        self._model_called = False
        freeze_start_up_heap()

    @property
    def tokenizer(self):
        return self.structured.tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer) -> None:
        self.structured.tokenizer = tokenizer

    def _check_cache_fits(self, num_blocks: int) -> None:
        bs = self.config.cache_config.block_size
        max_len = self.config.model_config.max_model_len
        capacity = num_blocks * bs
        logger.info(
            "KV cache: %d blocks of %d tokens = %d tokens; %.2f sequences of max_model_len %d fit",
            num_blocks, bs, capacity, capacity / max_len, max_len,
        )
        if capacity < max_len:
            raise ValueError(
                f"the KV cache holds {capacity} tokens ({num_blocks} blocks of {bs}), fewer than one "
                f"sequence of max_model_len {max_len}; lower max_model_len to at most {capacity} "
                "or give the cache more memory"
            )

    def add_request(self, request: Request) -> None:
        """Queues a request. Ids are unique by construction (Processor), so a live id again is the
        caller's bug: ValueError, and the live request is left alone."""
        if request.sampling_params.structured_outputs is not None:
            if request.request_id in self.scheduler.requests:
                raise ValueError(f"request_id {request.request_id!r} is already in use")
            self.structured.add_request(request)  # enters the scheduler once its grammar is compiled
            return
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.structured.abort(request_ids)
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_by_stop_string(self, request_id: str, stop: str) -> None:
        self.scheduler.finish_requests(request_id, RequestStatus.FINISHED_STOPPED, stop)

    def has_unfinished_requests(self) -> bool:
        return (self.scheduler.has_unfinished_requests() or self._in_flight is not None or bool(self._batches)
                or self.structured.has_waiting())

    def step(self) -> list[EngineCoreOutput]:
        """One step. A step that raises ends the requests it computed with an error and nothing else: the
        other requests go on (recomputed), unless the executor cannot recover (a broken device), in which
        case the exception propagates and the engine is dead."""
        self._submitting = None
        # Requests whose grammar compiled join the queue; those whose compile failed end here.
        idle = not self.scheduler.has_unfinished_requests() and self._in_flight is None and not self._batches
        failed = self.structured.admit(self.scheduler, idle)
        if failed and self.emit_outputs is not None:
            self.emit_outputs(failed)
            failed = []
        try:
            if self.async_scheduling:
                return failed + self._step_async()
            if self.max_batches > 1:
                return failed + self._step_batches()
            if not self.scheduler.has_unfinished_requests():
                return failed
            scheduler_output = self._submitting = self.scheduler.schedule()
            self.structured.fill_bitmask(scheduler_output, self.scheduler)
            self._model_called = True
            runner_output = self.executor.execute_model(scheduler_output)
            return failed + self._update(scheduler_output, runner_output)
        except Exception as e:  # noqa: BLE001 - contained below, or re-raised by the executor's reset
            return self._recover(e)

    def step_lockstep(self) -> list[EngineCoreOutput]:
        """One step that makes exactly one model call, for cores whose ranks share the MoE layers' experts
        (data parallelism with expert parallelism): the scheduled step, or, when this core has nothing to
        run (no request, or none schedulable: all waiting for blocks or grammars), an empty one whose MoE
        layers meet the other cores' ranks with zero tokens. Steps are synchronous here (no async
        scheduling, one batch in flight), so ``step`` makes at most one call."""
        self._model_called = False
        outputs = self.step() if self.has_unfinished_requests() else []
        if not self._model_called:
            self.executor.execute_dummy_batch()
        return outputs

    def _update(self, so: SchedulerOutput, runner_output) -> list[EngineCoreOutput]:
        outputs = self.scheduler.update_from_output(so, runner_output)
        return self.structured.accept_outputs(outputs, self.scheduler)

    def _recover(self, error: Exception) -> list[EngineCoreOutput]:
        failed: set[str] = set()
        for so in (self._submitting, self._in_flight, *self._batches):
            if so is not None:
                failed.update(so.num_scheduled_tokens)
        if not failed:
            raise error  # nothing ran that could be blamed (the scheduler itself failed): not recoverable
        if self.lockstep:
            # A step that failed part-way left the other cores' ranks inside its MoE layers' collectives, or
            # out of step with this core's: the group cannot go on, so the engine dies (and the front-end with
            # it ends every request) rather than hanging.
            raise error
        logger.exception("a step of %d requests failed", len(failed))
        self.executor.reset()  # raises when the device itself is broken: then the engine dies
        self._in_flight = self._submitting = None
        self._batches.clear()
        # Only the exception's type: its text may hold internals that are not the client's business.
        outputs = self.scheduler.recover_from_failed_step(failed, f"the model step failed ({type(error).__name__})")
        if self.emit_outputs is not None:
            self.emit_outputs(outputs)
            return []
        return outputs

    def _step_batches(self) -> list[EngineCoreOutput]:
        """Tops the batches in flight up to ``max_batches``, then applies the oldest one's output.

        Each stage works on a different batch while the later stages run the earlier ones. The scheduler
        leaves a request out while a batch holding it is in flight, so batches never share a request and
        each one's inputs are known when it is scheduled.
        """
        while len(self._batches) < self.max_batches and self.scheduler.has_unfinished_requests():
            so = self._submitting = self.scheduler.schedule()
            if so.is_empty and not so.preempted_req_ids:
                # Nothing schedulable until a batch lands; the finished ids go with the next batch.
                self.scheduler.finished_req_ids |= so.finished_req_ids
                break
            self.structured.fill_bitmask(so, self.scheduler)
            self.executor.submit(so)
            if so.is_empty:
                break
            self._batches.append(so)
        self._submitting = None
        if not self._batches:
            return []
        runner_output = self.executor.take_output()
        # Until its output is applied, a failure still ends the batch's requests.
        self._submitting = self._batches.popleft()
        return self._update(self._submitting, runner_output)

    def _step_async(self) -> list[EngineCoreOutput]:
        """Submits step N+1, then applies step N's output: the device never waits for this CPU work.

        Step N+1 is scheduled before step N's tokens are known; each request sampled by step N
        counts one pending token, which the runner reads from the device. A request that step N
        ends (EOS, stop token, stop string) has computed one token too many in N+1; that output
        is dropped, since the request is gone by then.
        """
        submitted: SchedulerOutput | None = None
        constrained: SchedulerOutput | None = None
        # With an emitter, step N's outputs leave before step N+1's sampling is launched: that launch
        # then runs while the forward pass does, instead of delaying every token's delivery.
        emit = self.emit_outputs if self._in_flight is not None else None
        if self.scheduler.has_unfinished_requests():
            t0 = time.perf_counter()
            submitted = self._submitting = self.scheduler.schedule()
            schedule_s = time.perf_counter() - t0
            # Structured outputs: a constrained row's bitmask depends on the token step N samples for it,
            # so this step's sampling waits until step N's output has advanced the matchers (below),
            # while its forward pass runs; the mask is filled then, on the host, behind that pass.
            if self.structured.samples_constrained(submitted, self.scheduler):
                constrained = submitted
            # Submitted even when empty: the runner must still forget finished requests.
            launch_s = self.executor.submit(
                submitted, defer_sampling=emit is not None or constrained is not None
            ) or 0.0
            # Only the host work before the device has the step queued: the submit then also waits for
            # step N's results (nearly a whole step) and launches sampling behind the forward pass, and
            # budgeting those would widen the just-in-time margin until it never delays at all.
            self._submit_host_s += _EMA * (schedule_s + launch_s - self._submit_host_s)
            if submitted.is_empty:
                submitted = None
        outputs: list[EngineCoreOutput] = []
        if self._in_flight is not None:
            runner_output = self.executor.take_output()
            self._output_at = time.perf_counter()
            if self._jit:
                self._record_device_time(self._in_flight, runner_output.device_time_s)
            outputs = self._update(self._in_flight, runner_output)
            if emit is not None:
                emit(outputs)
                outputs = []
        if constrained is not None:
            # The mask is filled in a thread while this one hands the outputs on and schedules the
            # next step; the runner launches this step's sampling once it is ready, at the latest at
            # the next submit (the device, busy with the forward pass, does not wait for either).
            self.structured.fill_bitmask(constrained, self.scheduler, background=True)
        else:
            self.executor.launch_sampling()
        self._in_flight = submitted
        return outputs

    @staticmethod
    def _decode_batch(so: SchedulerOutput) -> int | None:
        """The number of requests of a pure-decode step (one token each), else None."""
        n = len(so.num_scheduled_tokens)
        return n if n and so.total_num_scheduled_tokens == n else None

    def _record_device_time(self, so: SchedulerOutput, device_time_s: float | None) -> None:
        batch = self._decode_batch(so)
        if batch is None or device_time_s is None:
            return
        old = self._decode_device_s.get(batch)
        self._decode_device_s[batch] = device_time_s if old is None else old + _EMA * (device_time_s - old)

    def submit_delay_s(self) -> float:
        """How long the caller may wait (taking in new requests) before the next ``step`` loses nothing.

        Non-zero only with just-in-time submission, while a pure-decode step of at most _JIT_MAX_BATCH
        requests, whose duration has been measured for its batch size, runs and nobody is waiting: then
        the next step is best scheduled just before the device finishes this one, so that requests
        arriving meanwhile join it.
        """
        so = self._in_flight
        if not self._jit or so is None or self._output_at is None or self.scheduler.waiting:
            return 0.0
        if so.grammar_bitmask is not None:
            return 0.0  # its sampling launches with the next submit (structured outputs): no waiting
        batch = self._decode_batch(so)
        if batch is None or batch > _JIT_MAX_BATCH:
            return 0.0
        expected = self._decode_device_s.get(batch)
        if expected is None:
            return 0.0
        margin = 2.0 * self._submit_host_s + _JIT_SAFETY_S
        return max(0.0, self._output_at + expected - margin - time.perf_counter())

    def stats(self) -> SchedulerStats:
        stats = self.scheduler.make_stats()
        stats.num_waiting_reqs += self.structured.num_waiting()
        return stats

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.kv_cache_manager.reset_prefix_cache()

    def shutdown(self) -> None:
        self.structured.shutdown()
        self.executor.shutdown()
        unfreeze_heap()
