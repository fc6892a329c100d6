"""Worker: owns one device, its model runner, the sizing of the KV cache from memory, and start-up timing."""
from __future__ import annotations

import gc
import logging
import os
import time
from dataclasses import dataclass, field

import torch

from pagedllm import envs
from pagedllm.config import EngineConfig
from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.worker.cuda_graphs import graph_sizes
from pagedllm.worker.model_runner import ModelRunner

logger = logging.getLogger("pagedllm")

# Without an explicit kv_cache_memory_bytes, the CPU cache takes this fraction of available RAM.
CPU_KV_CACHE_FRACTION = 0.2
_GiB = 1 << 30
# Kept aside for the CUDA graphs' private pool on top of the activation estimate: graph bookkeeping
# and the capture stream's cuBLAS workspace.
_GRAPH_POOL_BASE_BYTES = 256 << 20


def _available_ram_bytes() -> int:
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@dataclass
class MemoryProfile:
    """Where the GPU's memory goes, in bytes, as measured (and, for the graph pool, estimated) at start."""

    total: int = 0
    usable: int = 0  # total * gpu_memory_utilization
    weights: int = 0
    activations: int = 0  # peak of a max_num_batched_tokens forward plus its logits
    sampler: int = 0  # logits and sampling scratch at max_num_seqs rows (estimate)
    attention: int = 0  # the attention backend's own scratch at max_num_seqs + 1 requests
    moe_workspace: int = 0  # the largest MoE layer's fused-experts scratch at max_num_batched_tokens (estimate)
    graph_pool: int = 0  # estimate before capture; replaced by the measured size after it
    non_torch: int = 0  # CUDA context, library workspaces, other processes
    kv_cache: int = 0

    def summary(self) -> str:
        g = lambda n: n / _GiB  # noqa: E731
        return (
            f"total {g(self.total):.2f} GiB, usable {g(self.usable):.2f}, weights {g(self.weights):.2f}, "
            f"peak activations {g(self.activations):.2f}, sampler {g(self.sampler):.2f}, "
            f"attention scratch {g(self.attention):.2f}, "
            + (f"MoE workspace {g(self.moe_workspace):.2f}, " if self.moe_workspace else "")
            + f"CUDA graph pool {g(self.graph_pool):.2f}, non-torch {g(self.non_torch):.2f}, "
            f"KV cache {g(self.kv_cache):.2f} GiB"
        )


@dataclass
class StartupTimes:
    """Seconds per start-up phase of this worker."""

    phases: dict[str, float] = field(default_factory=dict)

    def add(self, name: str, seconds: float) -> None:
        self.phases[name] = self.phases.get(name, 0.0) + seconds

    def summary(self) -> str:
        parts = ", ".join(f"{k} {v:.2f} s" for k, v in self.phases.items())
        return f"{parts}; total {sum(self.phases.values()):.2f} s"


class Worker:
    def __init__(self, config: EngineConfig, local_rank: int = 0) -> None:
        """``local_rank``: which of this host's GPUs a rank's worker owns (one per rank)."""
        self.config = config
        self.device = config.device_config.torch_device
        if self.device.type == "cuda":
            self.device = torch.device("cuda", self.device.index or local_rank)
            # torch 2.11 rejects a bare torch.device("cuda") here: it wants an index.
            torch.cuda.set_device(self.device)
            from pagedllm.kernels import launch  # triton is needed on CUDA only

            launch.set_pdl(envs.PAGEDLLM_PDL)
        torch.manual_seed(config.model_config.seed)
        self.model_runner = ModelRunner(config, self.device)
        self.memory = MemoryProfile()
        self.startup = StartupTimes()

    def load_model(self) -> None:
        t0 = time.perf_counter()
        self.model_runner.load_model()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.memory.weights = torch.cuda.memory_allocated()
        self.startup.add("load", time.perf_counter() - t0)
        logger.info("model weights loaded in %.2f s", self.startup.phases["load"])
        _log_experts(self.model_runner.model)
        if self.device.type == "cpu":
            t0 = time.perf_counter()
            packed = self.model_runner.prepack_cpu_weights()
            self.startup.add("prepack", time.perf_counter() - t0)
            if packed:
                logger.info("%d weights reordered for oneDNN in %.2f s", packed, self.startup.phases["prepack"])

    def determine_num_blocks(self) -> int:
        cc, mc = self.config.cache_config, self.config.model_config
        runner = self.model_runner
        # This rank's share: its pipeline stage's layers, its tensor rank's KV heads.
        block_bytes = cc.block_size * mc.kv_bytes_per_token(
            self.config.kv_cache_dtype, runner.layer_end - runner.layer_start, runner.num_kv_heads)
        t0 = time.perf_counter()
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
            # memory; cap it so a small model on a big machine doesn't take gigabytes it cannot use.
            sc = self.config.scheduler_config
            cap_blocks = sc.max_num_seqs * -(-sc.max_model_len // cc.block_size)
            num_blocks = min(budget // block_bytes, cap_blocks)
            logger.info(
                "KV cache on CPU: %.0f%% of %.2f GiB available RAM allowed, using %.3f GiB",
                100 * CPU_KV_CACHE_FRACTION, avail / _GiB, num_blocks * block_bytes / _GiB,
            )
        self.startup.add("profile", time.perf_counter() - t0)
        return int(num_blocks)

    def _graph_pool_estimate(self, activations: int, profile_tokens: int) -> int:
        """A graph's activations scale with its token count, and the largest graph (the mixed one of
        max_num_batched_tokens) sets the shared pool: about the profiled forward's activations."""
        if not self.model_runner.use_cuda_graphs:
            return 0
        sc = self.config.scheduler_config
        mixed, decode = graph_sizes(self.config.graph_config, sc.max_num_seqs, sc.max_num_batched_tokens)
        largest = max(mixed + decode, default=0)
        share = min(1.0, largest / max(profile_tokens, 1))
        return int(activations * share) + _GRAPH_POOL_BASE_BYTES

    def _profile_cuda_blocks(self, block_bytes: int) -> int:
        cc, sc, mc = self.config.cache_config, self.config.scheduler_config, self.config.model_config
        mem = self.memory
        # An engine shut down earlier in this process may still hold its cache and graphs in reference cycles:
        # collected now, they are not counted as this engine's weights.
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        free_before, total = torch.cuda.mem_get_info()
        weights = torch.cuda.memory_allocated()
        profile_tokens = min(sc.max_num_batched_tokens, sc.max_model_len * sc.max_num_seqs)
        self.model_runner.profile_run(profile_tokens)
        torch.cuda.synchronize()
        mem.total, mem.weights = total, weights
        mem.usable = int(total * cc.gpu_memory_utilization)
        mem.activations = torch.cuda.max_memory_allocated() - weights
        torch.cuda.empty_cache()
        # Logits in float32 plus a sort's values and int64 indices when a batch samples with top-p.
        mem.sampler = sc.max_num_seqs * mc.vocab_size * 16
        mem.attention = self.model_runner.attn_backend.workspace_bytes(
            sc.max_num_seqs + 1, self.model_runner.num_heads, self.model_runner.num_kv_heads, mc.head_size,
            self.config.kv_cache_dtype.itemsize)
        mem.graph_pool = self._graph_pool_estimate(mem.activations, profile_tokens)
        from pagedllm.layers.fused_moe.workspace import model_moe_workspace_bytes

        mem.moe_workspace = model_moe_workspace_bytes(self.model_runner.model, sc.max_num_batched_tokens)
        # The profiled forward already held one layer's scratch when its routing reached the fused kernels;
        # the estimate is a floor, so a profile that fell short of it (another path, fewer pairs) still
        # leaves room for a full step's scratch.
        moe_extra = max(mem.moe_workspace - mem.activations, 0)
        # What other processes and this one's CUDA context hold counts against our share too.
        mem.non_torch = max(total - free_before - torch.cuda.memory_reserved(), 0)
        budget = (mem.usable - mem.non_torch - weights - mem.activations - moe_extra - mem.sampler - mem.attention
                  - mem.graph_pool)
        num_blocks = max(budget // block_bytes, 0)
        mem.kv_cache = num_blocks * block_bytes
        capacity = num_blocks * cc.block_size
        fits = capacity / sc.max_model_len
        logger.info("GPU memory: %s", mem.summary())
        logger.info(
            "KV cache (%s): %d blocks of %d tokens = %d tokens, %.2f sequences of max_model_len %d",
            str(self.config.kv_cache_dtype).removeprefix("torch."), num_blocks, cc.block_size, capacity, fits,
            sc.max_model_len,
        )
        if capacity < sc.max_model_len:
            raise ValueError(
                f"not even one sequence of max_model_len {sc.max_model_len} fits in GPU memory: after "
                f"{weights / _GiB:.2f} GiB of weights, {mem.activations / _GiB:.2f} GiB of activations and "
                f"{(mem.sampler + mem.attention + mem.graph_pool + mem.non_torch) / _GiB:.2f} GiB of other use, "
                f"the KV cache gets "
                f"{max(budget, 0) / _GiB:.2f} GiB = {capacity} tokens. The largest max_model_len that fits is "
                f"{capacity}; or raise gpu_memory_utilization (now {cc.gpu_memory_utilization}), lower "
                f"max_num_batched_tokens, or use --enforce-eager"
            )
        return num_blocks

    def initialize_cache(self, num_blocks: int) -> None:
        t0 = time.perf_counter()
        self.model_runner.initialize_kv_cache(num_blocks)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.startup.add("kv_alloc", time.perf_counter() - t0)
        if self.device.type == "cuda":
            sc, mc = self.config.scheduler_config, self.config.model_config
            self.model_runner.attn_backend.reserve_workspace(
                self.device, sc.max_num_seqs + 1, self.model_runner.num_heads, self.model_runner.num_kv_heads,
                mc.head_size, self.config.kv_cache_dtype.itemsize)
            # Triton compiles on first use; a variant first met mid-serving would stall every request.
            t0 = time.perf_counter()
            self.model_runner.warm_up_kernels()
            self.startup.add("kernel_warmup", time.perf_counter() - t0)
        if self.model_runner.use_cuda_graphs:
            t0 = time.perf_counter()
            self.model_runner.capture_cuda_graphs()
            self.startup.add("graph_capture", time.perf_counter() - t0)
            decode, mixed = self.model_runner.graph_runner, self.model_runner.mixed_graph_runner
            self.memory.graph_pool = decode.pool_bytes + mixed.pool_bytes
            logger.info(
                "captured %d CUDA graphs (decode batches %s; mixed batches of %s tokens) in %.2f s, pool %.3f GiB",
                len(decode.sizes) + len(mixed.sizes), ",".join(map(str, decode.sizes)),
                ",".join(map(str, mixed.sizes)), self.startup.phases["graph_capture"], self.memory.graph_pool / _GiB,
            )
        logger.info("worker start-up: %s", self.startup.summary())

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(scheduler_output)

    def submit(self, scheduler_output: SchedulerOutput, defer_sampling: bool = False) -> float:
        return self.model_runner.submit(scheduler_output, defer_sampling)

    def launch_sampling(self) -> None:
        self.model_runner.launch_sampling()

    def take_output(self) -> ModelRunnerOutput:
        return self.model_runner.take_output()

    def apply_sampled_tokens(self, sampled: dict[str, list[int]]) -> None:
        self.model_runner.apply_sampled_tokens(sampled)

    def reset(self) -> None:
        self.model_runner.reset()


def _log_experts(model: torch.nn.Module) -> None:
    """A MoE model's start-up line: its MoE layers and the experts this rank holds of each."""
    from pagedllm.layers.fused_moe import MoEExperts

    layers = [m for m in model.modules() if isinstance(m, MoEExperts)]
    if layers:
        first = layers[0]
        logger.info("moe: %d layers of %d experts (top-%d); this rank holds experts %d-%d of each (%d per rank, "
                    "%d expert-parallel ranks)", len(layers), first.num_experts, first.top_k, first.first_expert,
                    first.first_expert + first.num_local_experts - 1, first.num_local_experts,
                    first.ep_group.world_size)
