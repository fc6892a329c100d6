"""The configuration the scheduler and KV-cache manager read: plain values, no torch (EngineConfig holds them)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    enable_prefix_caching: bool = True
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    prefix_hash_algo: str = "sha256"
    cache_dtype: str = "auto"  # one of pagedllm.config.KV_CACHE_DTYPES


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    # Schedule step N+1 while the device runs step N (the runner feeds step N's sampled ids, still on
    # the device, as step N+1's inputs); outputs then arrive one step later.
    async_scheduling: bool = False
    # (Asynchronous mode, serving) Schedule step N+1 shortly before the device finishes step N instead of
    # as soon as N is launched, so a request that arrives meanwhile joins N+1 rather than N+2.
    submit_just_in_time: bool = False
    # Batches the engine keeps in flight at once (the pipeline-parallel size, so that every stage has one
    # to work on). Above 1 a request in a batch still in flight is left out of the next ones: its next
    # tokens depend on that batch's output.
    max_concurrent_batches: int = 1

    def __post_init__(self) -> None:
        if self.max_concurrent_batches < 1:
            raise ValueError(f"max_concurrent_batches must be at least 1, got {self.max_concurrent_batches}")
