"""Scheduler with several batches in flight (pipeline parallelism): no request is in two batches at once."""
from __future__ import annotations

import random

import pytest
from scheduler_harness import FILLER, FakeRunner, block_ids, free_count, make_req, make_sched


def _shape(so):
    cr = so.scheduled_cached_reqs
    return (so.num_scheduled_tokens,
            [(n.req_id, n.block_ids, n.num_computed_tokens) for n in so.scheduled_new_reqs],
            list(zip(cr.req_ids, cr.new_block_ids, cr.num_computed_tokens)))


def test_two_batches_in_flight_never_share_a_request():
    sched = make_sched(num_blocks=8, block_size=16, budget=16, max_concurrent_batches=2)
    runner = FakeRunner()
    sched.add_request(make_req("A", 20, max_tokens=2))
    sched.add_request(make_req("B", 10, base=5000, max_tokens=2))

    first = sched.schedule()  # A's first chunk
    assert _shape(first) == ({"A": 16}, [("A", [0], 0)], [])
    second = sched.schedule()  # A is in flight: B alone, although A has 4 prompt tokens left
    assert _shape(second) == ({"B": 10}, [("B", [1], 0)], [])
    assert sched.schedule().num_scheduled_tokens == {}  # both in flight: nothing to add
    assert sched.in_flight == {"A": 1, "B": 1}

    assert sched.update_from_output(first, runner.execute(first)) == []  # a partial prompt samples nothing
    third = sched.schedule()  # A's rest; B is still in flight
    assert _shape(third) == ({"A": 4}, [], [("A", [2], 16)])

    outs = sched.update_from_output(second, runner.execute(second))
    assert [(o.req_id, o.new_token_ids) for o in outs] == [("B", [FILLER])]
    fourth = sched.schedule()  # B's next token; A still in flight
    assert _shape(fourth) == ({"B": 1}, [], [("B", [], 10)])

    outs = sched.update_from_output(third, runner.execute(third))
    assert [(o.req_id, o.new_token_ids) for o in outs] == [("A", [FILLER])]
    fifth = sched.schedule()
    assert _shape(fifth) == ({"A": 1}, [], [("A", [], 20)])

    outs = sched.update_from_output(fourth, runner.execute(fourth))
    assert [(o.req_id, o.finish_reason) for o in outs] == [("B", "length")]
    outs = sched.update_from_output(fifth, runner.execute(fifth))
    assert [(o.req_id, o.finish_reason) for o in outs] == [("A", "length")]
    assert sched.in_flight == {} and not sched.has_unfinished_requests()
    assert free_count(sched) == 8


def test_one_batch_in_flight_lets_a_request_run_ahead():
    # The asynchronous single-batch mode is unchanged: a request's next step is scheduled while its
    # previous one is in flight (the runner feeds the pending token from the device).
    sched = make_sched(num_blocks=8, block_size=16, budget=16)
    sched.add_request(make_req("A", 10, max_tokens=3))
    first = sched.schedule()
    second = sched.schedule()
    assert (first.num_scheduled_tokens, second.num_scheduled_tokens) == ({"A": 10}, {"A": 1})
    assert sched.in_flight == {} and block_ids(sched, "A") == [0]


def test_an_empty_batch_while_the_only_running_request_is_in_flight():
    # Two blocks, both B's once it decodes past its prompt: A waits, and while B's batch is in flight
    # the next batch is empty rather than B a second time.
    sched = make_sched(num_blocks=2, block_size=16, budget=16, max_concurrent_batches=2)
    runner = FakeRunner()
    sched.add_request(make_req("B", 16, base=5000, max_tokens=20))
    b0 = sched.schedule()
    sched.update_from_output(b0, runner.execute(b0))  # B's prompt done: 1 block, one token sampled
    sched.add_request(make_req("A", 16, max_tokens=2))
    a0 = sched.schedule()  # B decodes into a second block; A does not fit beside it
    assert _shape(a0) == ({"B": 1}, [], [("B", [1], 16)])
    assert sched.schedule().num_scheduled_tokens == {}  # B in flight, A cannot get a block
    sched.update_from_output(a0, runner.execute(a0))
    assert sched.in_flight == {}


def test_each_batch_in_flight_takes_its_share_of_the_requests():
    # Four short prompts, two batches in flight: two requests each, so that both pipeline stages have
    # work, although the budget would fit all four in the first batch.
    sched = make_sched(num_blocks=8, block_size=16, budget=64, max_concurrent_batches=2)
    runner = FakeRunner()
    for k, rid in enumerate("ABCD"):
        sched.add_request(make_req(rid, 5, base=1000 * (k + 1), max_tokens=3))
    first, second = sched.schedule(), sched.schedule()
    assert _shape(first) == ({"A": 5, "B": 5}, [("A", [0], 0), ("B", [1], 0)], [])
    assert _shape(second) == ({"C": 5, "D": 5}, [("C", [2], 0), ("D", [3], 0)], [])
    assert sched.schedule().num_scheduled_tokens == {}  # all four in flight

    outs = sched.update_from_output(first, runner.execute(first))
    assert [(o.req_id, o.new_token_ids) for o in outs] == [("A", [FILLER]), ("B", [FILLER])]
    third = sched.schedule()  # A and B again, beside C and D still in flight
    assert _shape(third) == ({"A": 1, "B": 1}, [], [("A", [], 5), ("B", [], 5)])
    assert sched.in_flight == {"A": 1, "B": 1, "C": 1, "D": 1}


def test_max_concurrent_batches_below_one_is_refused():
    with pytest.raises(ValueError, match="max_concurrent_batches must be at least 1, got 0"):
        make_sched(max_concurrent_batches=0)


def _run_with_batches_in_flight(sc, batches: int) -> int:
    """One random scenario with up to ``batches`` batches in flight, driven as the engine core drives it.

    The runner executes each batch when it is sent, in order (as every pipeline stage does), and its
    output is applied only once the older batches' are. Returns how many preemptions happened."""
    from collections import deque

    from test_scheduler_random import FakeRunner as KVRunner
    from test_scheduler_random import check_blocks

    from pagedllm.config import CacheConfig, SchedulerConfig
    from pagedllm.core.request import Request, RequestStatus
    from pagedllm.core.scheduler import Scheduler
    from pagedllm.sampling_params import SamplingParams

    sched = Scheduler(SchedulerConfig(max_num_seqs=sc.max_num_seqs, max_num_batched_tokens=sc.budget,
                                      max_model_len=sc.max_model_len, enable_chunked_prefill=sc.chunked,
                                      max_concurrent_batches=batches),
                      CacheConfig(block_size=sc.block_size, enable_prefix_caching=sc.caching), sc.num_blocks)
    rng = random.Random(sc.seed)
    runner = KVRunner(sc.block_size, rng)
    arrivals: dict[int, list[Request]] = {}
    for i, spec in enumerate(sc.reqs):
        prompt = [rng.randint(10, 13) for _ in range(spec.prompt_len)]
        params = SamplingParams(max_tokens=spec.max_tokens, min_tokens=spec.min_tokens,
                                ignore_eos=spec.ignore_eos, stop_token_ids=spec.stop_token_ids)
        req = Request(f"r{i}", prompt, params, seed=0, eos_token_ids=frozenset({2}))
        arrivals.setdefault(spec.arrival_step, []).append(req)
    aborts = {step: pick for step, pick, _ in sc.aborts}
    in_flight: deque = deque()
    preemptions = step = 0
    while step <= max(arrivals) or sched.has_unfinished_requests() or in_flight:
        assert step < 4000, "no progress"
        for req in arrivals.get(step, []):
            sched.add_request(req)
        if step in aborts and sched.requests:  # possibly a request in a batch in flight
            live = sorted(sched.requests)
            sched.finish_requests(live[aborts[step] % len(live)], RequestStatus.FINISHED_ABORTED)
        while len(in_flight) < batches and sched.has_unfinished_requests():
            so = sched.schedule()
            if so.is_empty and not so.preempted_req_ids:
                sched.finished_req_ids |= so.finished_req_ids
                break
            ids = set(so.num_scheduled_tokens)
            assert all(ids.isdisjoint(b.num_scheduled_tokens) for b, _ in in_flight), "a request in two batches"
            preemptions += len(so.preempted_req_ids)
            check_blocks(sched)
            out = runner.execute(so)
            if so.is_empty:
                break
            in_flight.append((so, out))
        if in_flight:
            sched.update_from_output(*in_flight.popleft())
            check_blocks(sched)
        step += 1
    assert sched.in_flight == {} and sched.requests == {}
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == sc.num_blocks
    return preemptions


def test_random_runs_with_two_and_three_batches_in_flight_keep_the_kv_cache_right():
    # The runner checks that every position a request attends to holds that request's token: a block
    # freed (preemption, abort) while a batch still computes into it must not be handed out wrongly.
    from test_scheduler_random import Draw, build_scenario

    preemptions = 0
    for seed in range(150):
        sc = build_scenario(Draw(random.Random(seed).randint))
        preemptions += _run_with_batches_in_flight(sc, 2 + seed % 2)
    assert preemptions >= 5  # the runs do reach preemption
