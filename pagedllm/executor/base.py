"""Executor interface: how the engine core reaches its workers, in-process or in other processes."""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque

from pagedllm.config import EngineConfig
from pagedllm.core.scheduler_output import CachedRequestData, ModelRunnerOutput, SchedulerOutput


class Executor(ABC):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._outputs: deque[ModelRunnerOutput] = deque()

    @abstractmethod
    def determine_num_blocks(self) -> int:
        """KV-cache blocks every worker can hold (the minimum over workers)."""

    @abstractmethod
    def initialize_cache(self, num_blocks: int) -> None:
        ...

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Runs one step to completion and returns its output."""

    def execute_dummy_batch(self) -> None:
        """A step without requests. Under data parallelism with expert parallelism each rank answers it with its
        MoE layers' collectives over zero tokens: a core that has nothing to run still meets the other cores'
        ranks in every MoE layer of their step."""
        self.execute_model(SchedulerOutput([], CachedRequestData(), {}, 0, set(), set()))

    def submit(self, scheduler_output: SchedulerOutput, defer_sampling: bool = False) -> float:
        """Launches one step; a non-empty one's output comes from a later ``take_output``. Returns the
        host seconds from the call until the step's device work was queued: the part of the call that
        a device finishing the previous step would wait for. ``defer_sampling``: the step's sampling may
        wait for ``launch_sampling``, so that the previous step's output can be taken first.

        This default runs the step at once (no device runs ahead, so 0.0); executors whose workers can
        run ahead override all three.
        """
        output = self.execute_model(scheduler_output)
        if not scheduler_output.is_empty:
            self._outputs.append(output)
        return 0.0

    def launch_sampling(self) -> None:
        """Launches the sampling that a ``submit(..., defer_sampling=True)`` left behind, if any."""

    def take_output(self) -> ModelRunnerOutput:
        """The output of the oldest submitted non-empty step not yet taken (waits for it)."""
        return self._outputs.popleft()

    def reset(self) -> None:
        """After a failed step: drops every step in flight and every request's state, so that requests
        come back as new ones. Raises when the device cannot go on (a CUDA error poisons its context)."""
        self._outputs.clear()

    def check_health(self) -> None:
        """Raises when a worker can no longer serve (it died); called while the engine is idle."""

    def shutdown(self) -> None:
        pass


class UniProcExecutor(Executor):
    """One worker in this process: the CPU path and single-GPU serving."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        from pagedllm.worker.worker import Worker

        pc = config.parallel_config
        if pc.dp_expert_parallel:
            # This process is its core's only rank: it joins the other cores' ranks for the MoE layers.
            from pagedllm.executor.rank_worker import join_model_parallel

            join_model_parallel(config, rank=0)
        self.worker = Worker(config)
        self.worker.load_model()

    def determine_num_blocks(self) -> int:
        return self.worker.determine_num_blocks()

    def initialize_cache(self, num_blocks: int) -> None:
        self.worker.initialize_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def submit(self, scheduler_output: SchedulerOutput, defer_sampling: bool = False) -> float:
        return self.worker.submit(scheduler_output, defer_sampling)

    def launch_sampling(self) -> None:
        self.worker.launch_sampling()

    def take_output(self) -> ModelRunnerOutput:
        return self.worker.take_output()

    def reset(self) -> None:
        super().reset()
        self.worker.reset()

    def shutdown(self) -> None:
        if self.config.parallel_config.dp_expert_parallel:
            from pagedllm.distributed.parallel_state import destroy_model_parallel

            destroy_model_parallel()
