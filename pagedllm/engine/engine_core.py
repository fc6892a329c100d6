"""EngineCore: the scheduler and the executor in one loop; step() = schedule, execute, update."""
from __future__ import annotations

import logging

from pagedllm.config import EngineConfig
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler, SchedulerStats
from pagedllm.core.scheduler_output import EngineCoreOutput, SchedulerOutput
from pagedllm.executor.base import Executor

logger = logging.getLogger("pagedllm")


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
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_by_stop_string(self, request_id: str, stop: str) -> None:
        self.scheduler.finish_requests(request_id, RequestStatus.FINISHED_STOPPED, stop)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None

    def step(self) -> list[EngineCoreOutput]:
        if self.async_scheduling:
            return self._step_async()
        if not self.scheduler.has_unfinished_requests():
            return []
        scheduler_output = self.scheduler.schedule()
        runner_output = self.executor.execute_model(scheduler_output)
        return self.scheduler.update_from_output(scheduler_output, runner_output)

    def _step_async(self) -> list[EngineCoreOutput]:
        """Submits step N+1, then applies step N's output: the device never waits for this CPU work.

        Step N+1 is scheduled before step N's tokens are known; each request sampled by step N
        counts one pending token, which the runner reads from the device. A request that step N
        ends (EOS, stop token, stop string) has computed one token too many in N+1; that output
        is dropped, since the request is gone by then.
        """
        submitted: SchedulerOutput | None = None
        if self.scheduler.has_unfinished_requests():
            submitted = self.scheduler.schedule()
            # Submitted even when empty: the runner must still forget finished requests.
            self.executor.submit(submitted)
            if submitted.is_empty:
                submitted = None
        outputs: list[EngineCoreOutput] = []
        if self._in_flight is not None:
            runner_output = self.executor.take_output()
            outputs = self.scheduler.update_from_output(self._in_flight, runner_output)
        self._in_flight = submitted
        return outputs

    def stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.kv_cache_manager.reset_prefix_cache()

    def shutdown(self) -> None:
        self.executor.shutdown()
