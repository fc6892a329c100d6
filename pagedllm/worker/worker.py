"""Worker: owns one device, its model runner, and the sizing of the KV cache from memory."""
from __future__ import annotations

import logging
import os
import time

import torch

from pagedllm.config import EngineConfig
from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.worker.model_runner import ModelRunner

logger = logging.getLogger("pagedllm")

# Without an explicit kv_cache_memory_bytes, the CPU cache takes this fraction of available RAM.
CPU_KV_CACHE_FRACTION = 0.2
_GiB = 1 << 30


def _available_ram_bytes() -> int:
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class Worker:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = config.device_config.torch_device
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        torch.manual_seed(config.model_config.seed)
        self.model_runner = ModelRunner(config, self.device)

    def load_model(self) -> None:
        t0 = time.perf_counter()
        self.model_runner.load_model()
        logger.info("model weights loaded in %.2f s", time.perf_counter() - t0)

    def determine_num_blocks(self) -> int:
        cc, mc = self.config.cache_config, self.config.model_config
        block_bytes = cc.block_size * mc.kv_bytes_per_token()
        if cc.num_gpu_blocks_override is not None:
            num_blocks = cc.num_gpu_blocks_override
        elif cc.kv_cache_memory_bytes is not None:
            num_blocks = cc.kv_cache_memory_bytes // block_bytes
        elif self.device.type == "cuda":
            num_blocks = self._profile_cuda_blocks(block_bytes)
        else:
            avail = _available_ram_bytes()
            budget = int(avail * CPU_KV_CACHE_FRACTION)
            # More blocks than max_num_seqs full-length sequences only lengthen the prefix cache's
            # memory; cap it so a small model on a big machine doesn't zero gigabytes at start.
            sc = self.config.scheduler_config
            cap_blocks = sc.max_num_seqs * -(-sc.max_model_len // cc.block_size)
            num_blocks = min(budget // block_bytes, cap_blocks)
            logger.info(
                "KV cache on CPU: %.0f%% of %.2f GiB available RAM allowed, using %.3f GiB",
                100 * CPU_KV_CACHE_FRACTION, avail / _GiB, num_blocks * block_bytes / _GiB,
            )
        return int(num_blocks)

    def _profile_cuda_blocks(self, block_bytes: int) -> int:
        cc, sc = self.config.cache_config, self.config.scheduler_config
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        free_before, total = torch.cuda.mem_get_info()
        weights = torch.cuda.memory_allocated()
        self.model_runner.profile_run(min(sc.max_num_batched_tokens, sc.max_model_len * sc.max_num_seqs))
        torch.cuda.synchronize()
        activations = torch.cuda.max_memory_allocated() - weights
        torch.cuda.empty_cache()
        # What other processes hold counts against our share too.
        used_elsewhere = total - free_before - torch.cuda.memory_reserved()
        budget = int(total * cc.gpu_memory_utilization) - max(used_elsewhere, 0) - weights - activations
        logger.info(
            "GPU memory: total %.2f GiB, weights %.2f GiB, peak activations %.2f GiB, KV cache %.2f GiB",
            total / _GiB, weights / _GiB, activations / _GiB, max(budget, 0) / _GiB,
        )
        return max(budget // block_bytes, 0)

    def initialize_cache(self, num_blocks: int) -> None:
        self.model_runner.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(scheduler_output)
