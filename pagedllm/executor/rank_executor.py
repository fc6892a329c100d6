"""RankExecutor: what the mp and ray executors share (steps to every rank, sampled tokens relayed, steps in flight).

Every step goes to every rank; the sampling rank's answer is the step's output, and its sampled tokens go
to the other ranks with the next message. Subclasses only move messages: ``_send`` hands one message to
every rank and returns a handle to its answers, ``_answers`` waits for them (every rank's, in rank order)
and fails the executor on a rank's failure, ``_stop_ranks`` stops them all. Ranks answer their messages
in the order sent, so several steps may be in flight at once.
"""
from __future__ import annotations

import logging
from abc import abstractmethod
from collections import deque

from pagedllm.config import EngineConfig
from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.executor import messages as m
from pagedllm.executor.base import Executor
from pagedllm.executor.rank_worker import WorkerFailedError

logger = logging.getLogger("pagedllm")


class RankExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        pc = config.parallel_config
        self.world_size = pc.world_size
        # The rank that samples: tensor rank 0 of the last pipeline stage.
        self.driver_rank = (pc.pipeline_parallel_size - 1) * pc.tensor_parallel_size
        # Tokens the sampling rank drew that the other ranks have not been sent yet.
        self._sampled: dict[str, list[int]] = {}
        # Steps sent with ``submit`` and not yet answered, oldest first: their answers' handle, and whether
        # the step was empty.
        self._pending: deque[tuple[object, bool]] = deque()
        # Set once a rank failed: every later call raises it.
        self._failed: WorkerFailedError | None = None

    @abstractmethod
    def _send(self, msg) -> object:
        """Sends ``msg`` to every rank; returns what ``_answers`` needs to wait for their answers."""

    @abstractmethod
    def _answers(self, handle) -> list:
        """Every rank's answer to the message behind ``handle``, in rank order."""

    @abstractmethod
    def _stop_ranks(self) -> None:
        """Stops every rank at once (after a failure: the others would wait in a collective forever)."""

    def _fail(self, rank: int, message: str) -> None:
        """Stops every rank and raises ``WorkerFailedError`` naming ``rank``, now and on every later call."""
        self._failed = WorkerFailedError(rank, message)
        logger.error("%s; stopping every worker", self._failed)
        self._stop_ranks()
        raise self._failed

    def _raise_if_failed(self) -> None:
        if self._failed is not None:
            raise self._failed

    def _call(self, msg) -> list:
        return self._answers(self._send(msg))

    def _send_step(self, scheduler_output: SchedulerOutput) -> object:
        self._raise_if_failed()  # before reading the step: after a failure, nothing is sent
        handle = self._send(m.execute_message(scheduler_output, self._sampled))
        self._sampled = {}
        return handle

    def _step_output(self, answers: list) -> ModelRunnerOutput:
        """The sampling rank's answer; its tokens go to the other ranks with the next message sent."""
        output = answers[self.driver_rank].output
        if output is None:
            output = ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        self._sampled.update((rid, toks) for rid, toks in zip(output.req_ids, output.sampled_token_ids) if toks)
        return output

    # ---- the Executor interface ---------------------------------------------------------------------
    def determine_num_blocks(self) -> int:
        return min(int(a.value) for a in self._call(m.DetermineNumBlocks()))

    def initialize_cache(self, num_blocks: int) -> None:
        self._call(m.InitializeCache(num_blocks))

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self._step_output(self._answers(self._send_step(scheduler_output)))

    def submit(self, scheduler_output: SchedulerOutput, defer_sampling: bool = False) -> float:
        """Sends the step and returns at once: with several batches in flight (pipeline parallelism) the
        first stage starts the next batch while the later stages still run this one. The step must not
        depend on the output of a step still in flight (the scheduler leaves such requests out)."""
        self._pending.append((self._send_step(scheduler_output), scheduler_output.is_empty))
        return 0.0

    def take_output(self) -> ModelRunnerOutput:
        # Empty steps (sent so that the ranks forget finished requests) have no output to hand back.
        while self._pending:
            handle, empty = self._pending.popleft()
            output = self._step_output(self._answers(handle))
            if not empty:
                return output
        raise RuntimeError("take_output() without a non-empty step in flight")

    def reset(self) -> None:
        super().reset()
        # Steps still in flight are waited for (their answers come first): one whose rank failed ends the
        # executor, as it would have.
        while self._pending:
            self._answers(self._pending.popleft()[0])
        self._sampled = {}
        self._call(m.Reset())
