"""One rank's worker body, shared by every multi-rank executor: join the ranks, load the shard, answer messages.

The mp executor drives it over a pipe, the Ray executor through actor calls; both hand it the same
msgpack messages (executor/messages.py) and get the same answers back, so a rank behaves alike under both.
"""
from __future__ import annotations

import os
import traceback

from pagedllm.config import EngineConfig
from pagedllm.executor import messages as m


class WorkerFailedError(RuntimeError):
    """A rank's worker raised or died; the engine cannot go on."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(f"worker rank {rank} failed: {message}")
        self.rank = rank


def where(exc: BaseException) -> str:
    """``Type: message (file:line in function)``, the innermost frame: a failure's first line to read."""
    frames = traceback.extract_tb(exc.__traceback__)
    at = f" ({os.path.basename(frames[-1].filename)}:{frames[-1].lineno} in {frames[-1].name})" if frames else ""
    return f"{type(exc).__name__}: {exc}{at}"


def join_model_parallel(config: EngineConfig, rank: int, init_method: str | None = None) -> None:
    """Joins rank ``rank`` of this engine core to its process groups. Under data parallelism with expert
    parallelism the world is every core's ranks, met at the address the front-end chose; else this core's
    ranks at ``init_method``."""
    import torch

    from pagedllm.distributed.parallel_state import init_model_parallel

    pc = config.parallel_config
    cuda = config.device_config.device == "cuda"
    if not cuda:
        # One CPU thread pool per rank: the ranks (of every core that shares the world) share the host's cores.
        ranks = pc.world_size * (pc.data_parallel_size if pc.dp_expert_parallel else 1)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks))
    if pc.dp_expert_parallel:
        init_model_parallel(pc.tensor_parallel_size, pc.pipeline_parallel_size, rank, pc.data_parallel_init_method,
                            backend="nccl" if cuda else "gloo", enable_expert_parallel=True,
                            data_parallel_size=pc.data_parallel_size, data_parallel_rank=pc.data_parallel_rank)
    else:
        init_model_parallel(pc.tensor_parallel_size, pc.pipeline_parallel_size, rank, init_method,
                            backend="nccl" if cuda else "gloo", enable_expert_parallel=pc.enable_expert_parallel)


class RankWorker:
    """A rank's Worker behind the message schema: ``start`` once, then ``handle`` every message."""

    def __init__(self, config: EngineConfig, rank: int, local_rank: int) -> None:
        """``local_rank``: the GPU index this rank owns among those its process sees."""
        self.config = config
        self.rank = rank
        self.local_rank = local_rank
        self.worker = None
        self.encoder = m.msgspec.msgpack.Encoder()
        self.decoder = m.input_decoder()

    def start(self, init_method: str) -> bytes:
        """Joins the process group at ``init_method`` and loads this rank's shard; answers ``Ready``."""
        import torch

        from pagedllm.worker.worker import Worker

        if self.config.device_config.device == "cuda":
            torch.cuda.set_device(self.local_rank)
        join_model_parallel(self.config, self.rank, init_method)
        self.worker = Worker(self.config, local_rank=self.local_rank)
        self.worker.load_model()
        return self.encoder.encode(m.Ready(self.rank, os.getpid()))

    def handle(self, data: bytes) -> bytes | None:
        """One message in, its answer out; None for ``Shutdown`` (after leaving the process group)."""
        msg = self.decoder.decode(data)
        worker = self.worker
        if isinstance(msg, m.Execute):
            so = m.scheduler_output_of(msg)
            driver = worker.model_runner.is_driver
            if msg.sampled and not driver:
                worker.apply_sampled_tokens(msg.sampled)
            out = worker.execute_model(so)
            return self.encoder.encode(m.StepDone(out if driver else None))
        if isinstance(msg, m.DetermineNumBlocks):
            return self.encoder.encode(m.Done(worker.determine_num_blocks()))
        if isinstance(msg, m.InitializeCache):
            worker.initialize_cache(msg.num_blocks)
            return self.encoder.encode(m.Done())
        if isinstance(msg, m.Reset):
            worker.reset()
            return self.encoder.encode(m.Done())
        if isinstance(msg, m.Shutdown):
            from pagedllm.distributed.parallel_state import destroy_model_parallel

            destroy_model_parallel()
            return None
        raise TypeError(f"unknown worker message {type(msg).__name__}")

    def failed(self, exc: BaseException) -> bytes:
        """The ``Failed`` answer that reports ``exc`` to the executor."""
        return self.encoder.encode(m.Failed(self.rank, where(exc), traceback.format_exc()))
