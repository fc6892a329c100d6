"""Randomized scheduler runs (hypothesis): arrivals, shared prefixes, aborts and preemption keep every invariant."""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.sampling_params import SamplingParams

EOS = 2
STOP = 3


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---- scenarios -----------------------------------------------------------------------------------


@dataclass
class ReqSpec:
    arrival_step: int
    prefix_id: int  # 0, 1: one of two shared prefixes; 2: tokens of its own
    prompt_len: int
    shared_len: int  # leading tokens taken from the shared prefix
    max_tokens: int | None
    min_tokens: int
    ignore_eos: bool
    stop_token_ids: list[int]
    prompt_logprobs: int | None
    cache_salt: str | None
    n: int  # siblings with the same prompt, added together


@dataclass
class Scenario:
    block_size: int
    max_model_len: int
    num_blocks: int
    chunked: bool
    budget: int
    max_num_seqs: int
    caching: bool
    seed: int
    reqs: list[ReqSpec]
    aborts: list[tuple[int, int, bool]]  # (step, pick among live requests, during the step)
    resets: list[int]  # steps before which reset_prefix_cache is tried


class Draw:
    """The scenario builder's source of choices: hypothesis (shrinkable) or a plain seeded Random."""

    def __init__(self, integers: Callable[[int, int], int]) -> None:
        self.int = integers

    def flag(self, percent: int) -> bool:
        return self.int(0, 99) < percent


def build_scenario(d: Draw) -> Scenario:
    bs = (2, 4)[d.int(0, 1)]
    max_model_len = d.int(6, 40)
    num_blocks = cdiv(max_model_len, bs) + d.int(0, 4)  # capacity >= one sequence of max_model_len
    chunked = d.flag(80)
    budget = d.int(1, 48) if chunked else d.int(max_model_len, max_model_len + 16)
    reqs = []
    for _ in range(d.int(1, 10)):
        prompt_len = d.int(1, max_model_len - 1)
        max_tokens = None if d.flag(10) else d.int(1, 10)
        reqs.append(
            ReqSpec(
                arrival_step=d.int(0, 12),
                prefix_id=d.int(0, 2),
                prompt_len=prompt_len,
                shared_len=d.int(0, prompt_len),
                max_tokens=max_tokens,
                min_tokens=d.int(0, min(2, max_tokens or 2)),
                ignore_eos=d.flag(20),
                stop_token_ids=[STOP] if d.flag(30) else [],
                prompt_logprobs=0 if d.flag(10) else None,
                cache_salt="salt" if d.flag(10) else None,
                n=2 if d.flag(15) else 1,
            )
        )
    aborts = [(d.int(0, 20), d.int(0, 99), d.flag(50)) for _ in range(d.int(0, 3))]
    resets = [d.int(0, 20) for _ in range(d.int(0, 2))]
    return Scenario(
        block_size=bs,
        max_model_len=max_model_len,
        num_blocks=num_blocks,
        chunked=chunked,
        budget=budget,
        max_num_seqs=d.int(1, 6),
        caching=d.flag(85),
        seed=d.int(0, 2**31),
        reqs=reqs,
        aborts=aborts,
        resets=resets,
    )


@st.composite
def scenarios(draw) -> Scenario:
    return build_scenario(Draw(lambda lo, hi: draw(st.integers(lo, hi))))


# ---- a fake runner that keeps a simulated KV cache ----------------------------------------------


@dataclass
class RunnerReq:
    tokens: list[int]  # prompt + outputs, as the runner knows them
    num_computed: int
    block_ids: list[int]


@dataclass
class FakeRunner:
    """Mirrors the model runner: applies the scheduler's diffs, writes each scheduled token into its KV slot,
    checks that every position a request attends to holds that request's token, and samples at the end."""

    block_size: int
    rng: random.Random
    kv: dict[tuple[int, int], int] = field(default_factory=dict)  # (block id, offset) -> token id
    reqs: dict[str, RunnerReq] = field(default_factory=dict)
    sampled: dict[str, list[int]] = field(default_factory=dict)  # every token ever sampled, per request

    def sample(self) -> int:
        x = self.rng.random()
        return EOS if x < 0.12 else STOP if x < 0.2 else self.rng.randint(10, 13)

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        bs = self.block_size
        for rid in so.finished_req_ids | so.preempted_req_ids:
            self.reqs.pop(rid, None)
        for nr in so.scheduled_new_reqs:
            assert nr.req_id not in self.reqs
            # A resumed request brings back exactly the outputs it had.
            assert nr.output_token_ids == self.sampled.get(nr.req_id, [])
            self.reqs[nr.req_id] = RunnerReq(
                list(nr.prompt_token_ids) + list(nr.output_token_ids), nr.num_computed_tokens, list(nr.block_ids)
            )
        cr = so.scheduled_cached_reqs
        for rid, new_blocks, nc in zip(cr.req_ids, cr.new_block_ids, cr.num_computed_tokens):
            st_ = self.reqs[rid]
            assert st_.num_computed == nc
            st_.block_ids.extend(new_blocks)
        req_ids = list(so.num_scheduled_tokens)
        # Every layer writes the whole batch's K/V before any request attends.
        for rid in req_ids:
            st_ = self.reqs[rid]
            end = st_.num_computed + so.num_scheduled_tokens[rid]
            assert end <= len(st_.tokens)
            assert len(st_.block_ids) == cdiv(end, bs)
            for pos in range(st_.num_computed, end):
                self.kv[(st_.block_ids[pos // bs], pos % bs)] = st_.tokens[pos]
        sampled = []
        for rid in req_ids:
            st_ = self.reqs[rid]
            st_.num_computed += so.num_scheduled_tokens[rid]
            for pos in range(st_.num_computed):
                got = self.kv.get((st_.block_ids[pos // bs], pos % bs))
                assert got == st_.tokens[pos], f"{rid} reads {got} at position {pos}, expected {st_.tokens[pos]}"
            if st_.num_computed == len(st_.tokens):
                tok = self.sample()
                st_.tokens.append(tok)
                self.sampled.setdefault(rid, []).append(tok)
                sampled.append([tok])
            else:
                sampled.append([])
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)


# ---- invariants ----------------------------------------------------------------------------------


def check_blocks(sched: Scheduler) -> None:
    kv = sched.kv_cache_manager
    pool = kv.block_pool
    bs = sched.block_size
    running = {r.request_id: r for r in sched.running}
    assert set(kv.req_to_blocks) == set(running), "only running requests hold blocks"
    holders: dict[int, list[tuple[str, int]]] = {}
    for rid, blocks in kv.req_to_blocks.items():
        req = running[rid]
        assert len(blocks) == cdiv(req.num_computed_tokens, bs)
        assert len({b.block_id for b in blocks}) == len(blocks)
        for i, b in enumerate(blocks):
            holders.setdefault(b.block_id, []).append((rid, i))
    free_ids = pool.free_queue.block_ids()
    assert len(free_ids) == len(set(free_ids)) == pool.get_num_free_blocks()
    assert set(free_ids).isdisjoint(holders)
    assert len(free_ids) + len(holders) == pool.num_blocks
    for b in pool.blocks:
        assert b.ref_cnt == len(holders.get(b.block_id, []))
    for h, b in pool.cached_blocks.items():
        assert b.block_hash == h
    # A block in two tables must be a cached full block at the same index, with matching hashes.
    for block_id, owners in holders.items():
        if len(owners) < 2:
            continue
        b = pool.blocks[block_id]
        assert b.block_hash is not None, f"block {block_id} shared by {owners} but not cached"
        assert pool.get_cached_block(b.block_hash) is b
        for rid, i in owners:
            hashes = running[rid].block_hashes(bs)
            assert i < len(hashes) and hashes[i] == b.block_hash


def check_work_conserving(sched: Scheduler, so: SchedulerOutput, sc: Scenario) -> None:
    """Budget left over means nothing else could run: every running request got tokens, and the head of
    the waiting queue did not fit (out of seats, whole prompt too big with chunking off, or out of blocks)."""
    left = sc.budget - so.total_num_scheduled_tokens
    if left <= 0 or so.preempted_req_ids:
        return
    assert all(r.request_id in so.num_scheduled_tokens for r in sched.running)
    if not sched.waiting or len(sched.running) >= sc.max_num_seqs:
        return
    kv = sched.kv_cache_manager
    head = sched.waiting[0]
    hits, n_hit = kv.get_computed_blocks(head)
    need = head.num_tokens - n_hit
    if not sc.chunked and need > left:
        return
    n = min(need, left)
    blocks_needed = cdiv(n_hit + n, sc.block_size) - len(hits) + sum(b.ref_cnt == 0 for b in hits)
    assert blocks_needed > kv.block_pool.get_num_free_blocks(), f"{head.request_id} fit but was left waiting"


def would_stop(req: Request, outputs: list[int], max_model_len: int) -> str | None:
    """The stop rule, restated: the finish reason after ``outputs`` (or None)."""
    p = req.sampling_params
    k = len(outputs)
    last = outputs[-1]
    if k >= p.min_tokens:
        if last in p.stop_token_ids or (not p.ignore_eos and last == EOS):
            return "stop"
    if (p.max_tokens is not None and k >= p.max_tokens) or req.num_prompt_tokens + k >= max_model_len:
        return "length"
    return None


@dataclass
class Stats:
    steps: int = 0
    preemptions: int = 0
    prefix_hits: int = 0
    aborts: int = 0
    stops: int = 0


def run_scenario(sc: Scenario) -> Stats:
    bs = sc.block_size
    sched = Scheduler(
        SchedulerConfig(
            max_num_seqs=sc.max_num_seqs,
            max_num_batched_tokens=sc.budget,
            max_model_len=sc.max_model_len,
            enable_chunked_prefill=sc.chunked,
        ),
        CacheConfig(block_size=bs, enable_prefix_caching=sc.caching),
        sc.num_blocks,
    )
    rng = random.Random(sc.seed)
    prefixes = [[rng.randint(10, 13) for _ in range(sc.max_model_len)] for _ in range(2)]
    runner = FakeRunner(bs, rng)
    arrivals: dict[int, list[Request]] = {}
    all_reqs: dict[str, Request] = {}
    for i, spec in enumerate(sc.reqs):
        own = [rng.randint(10, 13) for _ in range(spec.prompt_len)]
        shared = prefixes[spec.prefix_id][: spec.shared_len] if spec.prefix_id < 2 else []
        prompt = shared + own[len(shared) :]
        params = SamplingParams(
            max_tokens=spec.max_tokens,
            min_tokens=spec.min_tokens,
            ignore_eos=spec.ignore_eos,
            stop_token_ids=spec.stop_token_ids,
            prompt_logprobs=spec.prompt_logprobs,
        )
        for j in range(spec.n):
            rid = f"{j}_r{i}"
            req = Request(rid, prompt, params, seed=0, eos_token_ids=frozenset({EOS}), cache_salt=spec.cache_salt)
            arrivals.setdefault(spec.arrival_step, []).append(req)
            all_reqs[rid] = req
    aborts: dict[int, list[tuple[int, bool]]] = {}
    for step_i, pick, mid in sc.aborts:
        aborts.setdefault(step_i, []).append((pick, mid))

    finished: dict[str, str] = {}  # rid -> finish reason, recorded once
    reported: list[str] = []  # ids in finished_req_ids, over all steps
    stats = Stats()
    last_arrival = max(arrivals)

    def abort(pick: int) -> None:
        live = sorted(sched.requests)
        if not live:
            return
        rid = live[pick % len(live)]
        sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
        assert rid not in finished
        finished[rid] = "abort"
        stats.aborts += 1
        assert all_reqs[rid].status == RequestStatus.FINISHED_ABORTED

    expect_queries = expect_hits = 0
    step_i = 0
    while step_i <= last_arrival or sched.has_unfinished_requests():
        assert step_i < 2000, "no progress"
        for req in arrivals.get(step_i, []):
            sched.add_request(req)
        for pick, mid in aborts.get(step_i, []):
            if not mid:
                abort(pick)
        if step_i in sc.resets:
            all_free = sched.kv_cache_manager.block_pool.get_num_free_blocks() == sc.num_blocks
            assert sched.kv_cache_manager.reset_prefix_cache() is all_free
            if all_free:
                assert sched.kv_cache_manager.block_pool.cached_blocks == {}
        had_work = sched.has_unfinished_requests()
        waiting_before = [r.request_id for r in sched.waiting]
        running_before = [r.request_id for r in sched.running]
        computed_before = {rid: r.num_computed_tokens for rid, r in sched.requests.items()}

        so = sched.schedule()
        stats.steps += 1
        n_sched = so.num_scheduled_tokens
        assert so.total_num_scheduled_tokens == sum(n_sched.values())
        assert so.total_num_scheduled_tokens <= sc.budget
        assert len(n_sched) <= sc.max_num_seqs and len(sched.running) <= sc.max_num_seqs
        assert all(n > 0 for n in n_sched.values())
        if had_work:
            assert so.total_num_scheduled_tokens > 0, "a step with unfinished requests scheduled nothing"
        assert set(n_sched) <= {r.request_id for r in sched.running}
        assert not (so.preempted_req_ids & set(n_sched))
        assert so.preempted_req_ids <= set(running_before)
        stats.preemptions += len(so.preempted_req_ids)
        new_ids = [nr.req_id for nr in so.scheduled_new_reqs]
        # Running requests (oldest first) before waiting ones; waiting ones strictly first come first served.
        assert list(n_sched) == so.scheduled_cached_reqs.req_ids + new_ids
        assert so.scheduled_cached_reqs.req_ids == [r for r in running_before if r in n_sched]
        if so.preempted_req_ids:
            assert new_ids == []
            # Preempted: the newest running ones, now at the front of waiting in their old order.
            k = len(so.preempted_req_ids)
            assert set(running_before[-k:]) == so.preempted_req_ids
            assert [r.request_id for r in sched.waiting][:k] == running_before[-k:]
        assert new_ids == waiting_before[: len(new_ids)]
        for nr in so.scheduled_new_reqs:
            req = all_reqs[nr.req_id]
            assert nr.num_computed_tokens % bs == 0
            if not sc.caching or req.skips_prefix_cache:
                assert nr.num_computed_tokens == 0
            else:
                expect_queries += len(nr.prompt_token_ids) + len(nr.output_token_ids)
                expect_hits += nr.num_computed_tokens
            stats.prefix_hits += nr.num_computed_tokens > 0
        # Prefix-cache stats count each admission once, however often the request was looked up.
        kv_stats = sched.kv_cache_manager.stats
        assert (kv_stats.queries, kv_stats.hits) == (expect_queries, expect_hits)
        start = dict(zip(so.scheduled_cached_reqs.req_ids, so.scheduled_cached_reqs.num_computed_tokens))
        start.update((nr.req_id, nr.num_computed_tokens) for nr in so.scheduled_new_reqs)
        for rid, n in n_sched.items():
            req = all_reqs[rid]
            if rid not in new_ids:
                assert start[rid] == computed_before[rid]
            assert req.num_computed_tokens == start[rid] + n
            assert req.num_computed_tokens <= req.num_tokens
            assert req.num_computed_tokens < sc.max_model_len
            if not sc.chunked:
                assert req.num_computed_tokens == req.num_tokens, "a prompt was split with chunking off"
        for rid in so.preempted_req_ids:
            req = all_reqs[rid]
            assert req.status == RequestStatus.PREEMPTED and req.num_computed_tokens == 0
        assert not (so.finished_req_ids & set(sched.requests))
        reported.extend(so.finished_req_ids)
        check_blocks(sched)
        check_work_conserving(sched, so, sc)

        runner_out = runner.execute(so)
        for pick, mid in aborts.get(step_i, []):
            if mid:
                abort(pick)
        outs = sched.update_from_output(so, runner_out)

        for o in outs:
            req = all_reqs[o.req_id]
            assert o.req_id not in finished, f"{o.req_id} produced output after finishing"
            assert o.new_token_ids == runner.sampled[o.req_id][-1:]
            assert req.output_token_ids == runner.sampled[o.req_id]
            assert req.max_tokens is None or req.num_output_tokens <= req.max_tokens
            assert req.num_tokens <= sc.max_model_len
            # Stop exactly when the rule says so, never earlier.
            for k in range(1, req.num_output_tokens):
                assert would_stop(req, req.output_token_ids[:k], sc.max_model_len) is None
            expect = would_stop(req, req.output_token_ids, sc.max_model_len)
            assert o.finish_reason == expect
            if o.finish_reason is not None:
                finished[o.req_id] = o.finish_reason
                stats.stops += 1
                assert o.req_id not in sched.requests
                last = req.output_token_ids[-1]
                if o.finish_reason == "stop":
                    assert o.stop_reason == (last if last in req.sampling_params.stop_token_ids else None)
                else:
                    assert o.stop_reason is None
        check_blocks(sched)
        step_i += 1

    # Flush the last finished ids to the "runner".
    final = sched.schedule()
    assert final.is_empty
    reported.extend(final.finished_req_ids)

    pool = sched.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == sc.num_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert sched.kv_cache_manager.req_to_blocks == {}
    assert sched.kv_cache_manager.req_to_num_cached_blocks == {}
    assert sched.requests == {} and not sched.waiting and not sched.running
    assert set(finished) == set(all_reqs), "every request finishes"
    assert sorted(reported) == sorted(all_reqs), "every request is reported finished exactly once"
    for rid, req in all_reqs.items():
        assert req.is_finished and req.finish_reason == finished[rid]
    if sc.caching:
        assert pool.reset_prefix_cache() is True
    return stats


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_random_runs_keep_every_invariant(sc: Scenario):
    run_scenario(sc)


def test_random_scenarios_reach_preemption_prefix_hits_aborts_and_stops():
    """The generator is not toothless: across fixed seeds it preempts, hits the cache, aborts and stops."""
    total = Stats()
    for seed in range(40):
        r = random.Random(seed)
        s = run_scenario(build_scenario(Draw(r.randint)))
        for f in ("steps", "preemptions", "prefix_hits", "aborts", "stops"):
            setattr(total, f, getattr(total, f) + getattr(s, f))
    assert total.preemptions >= 5
    assert total.prefix_hits >= 5
    assert total.aborts >= 5
    assert total.stops >= 40
