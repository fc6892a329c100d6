"""A scheduler test harness: small schedulers and requests, and a fake runner that samples only when a step reaches a request's last known token."""
from __future__ import annotations

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.request import Request
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.scheduler_output import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from pagedllm.sampling_params import SamplingParams

EOS = 2
FILLER = 7  # what the fake model samples unless a script says otherwise


def make_sched(
    num_blocks: int = 64,
    block_size: int = 16,
    budget: int = 8192,
    max_num_seqs: int = 256,
    max_model_len: int = 2048,
    chunked: bool = True,
    caching: bool = True,
    max_concurrent_batches: int = 1,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=max_model_len,
            enable_chunked_prefill=chunked,
            max_concurrent_batches=max_concurrent_batches,
        ),
        CacheConfig(block_size=block_size, enable_prefix_caching=caching),
        num_blocks,
    )


def make_req(rid: str, prompt: int | list[int], base: int = 1000, **params) -> Request:
    """A request; an int prompt means that many distinct tokens starting at ``base``."""
    tokens = list(range(base, base + prompt)) if isinstance(prompt, int) else prompt
    params.setdefault("max_tokens", 100)
    return Request(rid, tokens, SamplingParams(**params), seed=0, eos_token_ids=frozenset({EOS}))


class FakeRunner:
    """Keeps the runner's view of each request and samples only when a step reaches its last known token."""

    def __init__(self, script: dict[str, list[int]] | None = None) -> None:
        self.script = script or {}
        self.known: dict[str, int] = {}  # tokens the runner knows (prompt + outputs it was told of/sampled)
        self.computed: dict[str, int] = {}
        self.block_ids: dict[str, list[int]] = {}

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for rid in so.finished_req_ids | so.preempted_req_ids:
            for d in (self.known, self.computed, self.block_ids):
                d.pop(rid, None)
        for nr in so.scheduled_new_reqs:
            self.known[nr.req_id] = len(nr.prompt_token_ids) + len(nr.output_token_ids)
            self.computed[nr.req_id] = nr.num_computed_tokens
            self.block_ids[nr.req_id] = list(nr.block_ids)
        cr = so.scheduled_cached_reqs
        for rid, new_blocks, nc in zip(cr.req_ids, cr.new_block_ids, cr.num_computed_tokens):
            assert self.computed[rid] == nc
            self.block_ids[rid].extend(new_blocks)
        req_ids = list(so.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for rid in req_ids:
            self.computed[rid] += so.num_scheduled_tokens[rid]
            assert self.computed[rid] <= self.known[rid]
            if self.computed[rid] == self.known[rid]:
                script = self.script.get(rid)
                tok = script.pop(0) if script else FILLER
                self.known[rid] += 1
                sampled.append([tok])
            else:
                sampled.append([])
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)


def step(sched: Scheduler, runner: FakeRunner) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    so = sched.schedule()
    assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
    assert so.total_num_scheduled_tokens <= sched.config.max_num_batched_tokens
    assert len(sched.running) <= sched.config.max_num_seqs
    return so, sched.update_from_output(so, runner.execute(so))


def free_count(sched: Scheduler) -> int:
    return sched.kv_cache_manager.block_pool.get_num_free_blocks()


def ref_cnts(sched: Scheduler) -> list[int]:
    return [b.ref_cnt for b in sched.kv_cache_manager.block_pool.blocks]


def block_ids(sched: Scheduler, rid: str) -> list[int]:
    return sched.kv_cache_manager.get_block_ids(rid)


def by_id(outs: list[EngineCoreOutput]) -> dict[str, EngineCoreOutput]:
    d = {o.req_id: o for o in outs}
    assert len(d) == len(outs)
    return d
