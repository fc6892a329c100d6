"""Which Executor runs an engine's workers, from ``parallel_config.distributed_executor_backend``."""
from __future__ import annotations

from pagedllm.config import EngineConfig
from pagedllm.executor.base import Executor, UniProcExecutor


def get_executor_class(config: EngineConfig) -> type[Executor]:
    backend = config.parallel_config.executor_backend
    if backend == "uni":
        return UniProcExecutor
    if backend == "mp":
        from pagedllm.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor
    if backend == "ray":
        from pagedllm.executor.ray_executor import RayExecutor

        return RayExecutor
    raise ValueError(f"distributed_executor_backend={backend!r} is not one of 'uni', 'mp', 'ray'")


def make_executor(config: EngineConfig) -> Executor:
    return get_executor_class(config)(config)
