"""CPU cost of one engine step with 256 running requests and a model that answers instantly.

Measures what the engine itself adds per step: scheduling, the runner's input preparation (the
real InputBatch code), the scheduler update and output processing. Usage:

    python benchmarks/engine_overhead.py [--num-reqs 256] [--steps 200] [--tokenizer DIR]
"""
from __future__ import annotations

import argparse
import statistics
import time

from transformers import LlamaConfig

from pagedllm.config import (
    CacheConfig, DeviceConfig, EngineConfig, LoadConfig, ModelConfig, ParallelConfig, SchedulerConfig,
)
from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.output_processor import OutputKind
from pagedllm.executor.base import Executor
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.input_batch import InputBatch


class InstantExecutor(Executor):
    """Runs the real input preparation, then 'samples' a fixed token without any model."""

    def __init__(self, config: EngineConfig, num_blocks: int) -> None:
        super().__init__(config)
        self.num_blocks = num_blocks
        self.input_batch = InputBatch(config.cache_config.block_size)

    def determine_num_blocks(self) -> int:
        return self.num_blocks

    def initialize_cache(self, num_blocks: int) -> None:
        pass

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.input_batch.update_states(so)
        b = self.input_batch.prepare(so)
        sampled = []
        for rid, keep in zip(b.req_ids, b.sampling_mask):
            if keep:
                self.input_batch.requests[rid].output_token_ids.append(1234)
            sampled.append([1234] if keep else [])
        return ModelRunnerOutput(req_ids=b.req_ids, sampled_token_ids=sampled)


def make_config(max_model_len: int, max_num_seqs: int) -> EngineConfig:
    import torch

    hf = LlamaConfig(vocab_size=32000, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                     max_position_embeddings=max_model_len)
    return EngineConfig(
        model_config=ModelConfig(model="stub", tokenizer=None, hf_config=hf, dtype=torch.float32,
                                 max_model_len=max_model_len, skip_tokenizer_init=True),
        cache_config=CacheConfig(block_size=16),
        scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=8192,
                                         max_model_len=max_model_len),
        parallel_config=ParallelConfig(),
        device_config=DeviceConfig("cpu"),
        load_config=LoadConfig("dummy"),
    )


def measure(num_reqs: int, steps: int, prompt_len: int, tokenizer, kind: OutputKind) -> list[float]:
    max_len = prompt_len + steps + 64
    config = make_config(max_len, num_reqs)
    blocks = num_reqs * (-(-max_len // 16)) + 16
    engine = LLMEngine(config, executor=InstantExecutor(config, blocks), tokenizer=tokenizer or None)
    if tokenizer is None:
        engine.tokenizer = None
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=steps + 32, detokenize=tokenizer is not None)
    for i in range(num_reqs):
        prompt = [(i * 7 + j) % 30000 + 100 for j in range(prompt_len)]
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params, kind)
    # Prefill everyone first, so the timed steps are 256-wide decode steps.
    while len(engine.engine_core.scheduler.running) < num_reqs or any(
        r.num_computed_tokens < r.num_tokens - 1 for r in engine.engine_core.scheduler.running
    ):
        engine.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-reqs", type=int, default=256)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--tokenizer", type=str, default=None, help="also measure with detokenization")
    args = ap.parse_args()
    rows = [("no detokenization, final outputs", None, OutputKind.FINAL_ONLY)]
    if args.tokenizer:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.tokenizer)
        rows += [("detokenize, final outputs", tok, OutputKind.FINAL_ONLY),
                 ("detokenize, streamed deltas", tok, OutputKind.DELTA)]
    print(f"{args.num_reqs} running requests, {args.steps} decode steps each")
    print(f"{'mode':36s} {'median ms/step':>15s} {'p90 ms/step':>12s}")
    for name, tok, kind in rows:
        t = sorted(measure(args.num_reqs, args.steps, args.prompt_len, tok, kind))
        print(f"{name:36s} {1e3 * statistics.median(t):15.3f} {1e3 * t[int(0.9 * len(t))]:12.3f}")


if __name__ == "__main__":
    main()
