"""Scheduler with several batches in flight (pipeline parallelism): no request is in two batches at once."""
from __future__ import annotations

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
