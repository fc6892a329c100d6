"""Scheduler: exact chunked-prefill schedules, decode-first ordering, preemption by recompute, FCFS, n > 1, bookkeeping, asynchronous steps."""
from __future__ import annotations

import pytest

from pagedllm.core.request import RequestStatus
from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from scheduler_harness import EOS, FILLER, FakeRunner, block_ids, by_id, free_count, make_req, make_sched, ref_cnts, step


# ---- token budget and chunked prefill -------------------------------------------------------------


def test_chunked_prefill_schedule_with_a_small_budget():
    sched = make_sched(budget=32)
    runner = FakeRunner()
    sched.add_request(make_req("A", 50, max_tokens=3))
    sched.add_request(make_req("B", 30, base=5000, max_tokens=3))

    so, outs = step(sched, runner)
    assert so.num_scheduled_tokens == {"A": 32}
    assert [(n.req_id, n.block_ids, n.num_computed_tokens) for n in so.scheduled_new_reqs] == [("A", [0, 1], 0)]
    assert outs == []  # a partial prompt samples nothing

    so, outs = step(sched, runner)
    assert so.num_scheduled_tokens == {"A": 18, "B": 14}
    assert list(so.num_scheduled_tokens) == ["A", "B"]  # the running request goes first
    cr = so.scheduled_cached_reqs
    assert (cr.req_ids, cr.new_block_ids, cr.num_computed_tokens) == (["A"], [[2, 3]], [32])
    assert [(n.req_id, n.block_ids, n.num_computed_tokens) for n in so.scheduled_new_reqs] == [("B", [4], 0)]
    assert [(o.req_id, o.new_token_ids, o.finish_reason) for o in outs] == [("A", [FILLER], None)]

    so, outs = step(sched, runner)
    assert so.num_scheduled_tokens == {"A": 1, "B": 16}
    cr = so.scheduled_cached_reqs
    assert (cr.req_ids, cr.new_block_ids, cr.num_computed_tokens) == (["A", "B"], [[], [5]], [50, 14])
    assert [o.req_id for o in outs] == ["A", "B"]

    so, outs = step(sched, runner)
    assert so.num_scheduled_tokens == {"A": 1, "B": 1}
    assert [(o.req_id, o.finish_reason) for o in outs] == [("A", "length"), ("B", None)]

    so, outs = step(sched, runner)
    assert so.num_scheduled_tokens == {"B": 1}
    assert so.finished_req_ids == {"A"}
    assert [(o.req_id, o.finish_reason, len(o.new_token_ids)) for o in outs] == [("B", "length", 1)]

    so = sched.schedule()
    assert so.is_empty and so.finished_req_ids == {"B"}
    assert not sched.has_unfinished_requests()
    assert free_count(sched) == 64


def test_decodes_take_one_token_each_and_run_before_waiting_prompts():
    sched = make_sched(budget=32)
    runner = FakeRunner()
    sched.add_request(make_req("A", 10, base=0))
    sched.add_request(make_req("B", 10, base=100))
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"A": 10, "B": 10}
    sched.add_request(make_req("C", 40, base=200))
    sched.add_request(make_req("D", 5, base=300))
    so, _ = step(sched, runner)
    assert list(so.num_scheduled_tokens.items()) == [("A", 1), ("B", 1), ("C", 30)]
    so, _ = step(sched, runner)
    # C's rest of the prompt after the decodes; D gets what remains.
    assert list(so.num_scheduled_tokens.items()) == [("A", 1), ("B", 1), ("C", 10), ("D", 5)]
    so, _ = step(sched, runner)
    assert list(so.num_scheduled_tokens.items()) == [("A", 1), ("B", 1), ("C", 1), ("D", 1)]


def test_max_num_seqs_caps_the_running_set():
    sched = make_sched(max_num_seqs=2)
    runner = FakeRunner()
    sched.add_request(make_req("A", 4, base=0, max_tokens=2))
    sched.add_request(make_req("B", 4, base=100, max_tokens=5))
    sched.add_request(make_req("C", 4, base=200, max_tokens=5))
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"A": 4, "B": 4}
    assert [r.request_id for r in sched.waiting] == ["C"]
    so, outs = step(sched, runner)
    assert so.num_scheduled_tokens == {"A": 1, "B": 1}
    assert by_id(outs)["A"].finish_reason == "length"
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"B": 1, "C": 4}


def test_without_chunked_prefill_a_prompt_waits_until_it_fits_whole():
    sched = make_sched(budget=32, chunked=False)
    runner = FakeRunner()
    sched.add_request(make_req("A", 20, base=0))
    sched.add_request(make_req("B", 20, base=100))
    sched.add_request(make_req("C", 5, base=200))
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"A": 20}  # B does not fit in the 12 left; C waits behind it
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"A": 1, "B": 20, "C": 5}
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"A": 1, "B": 1, "C": 1}


def test_token_budget_is_filled_exactly_and_never_exceeded():
    sched = make_sched(budget=7, block_size=4, num_blocks=64)
    runner = FakeRunner()
    for i in range(5):
        sched.add_request(make_req(f"r{i}", 5 + i, base=100 * i, max_tokens=4))
    totals = []
    while sched.has_unfinished_requests():
        so, _ = step(sched, runner)
        totals.append(so.total_num_scheduled_tokens)
    # 35 prompt tokens + 5 * 3 decode steps (the 4th token is sampled, never computed) = 50.
    assert sum(totals) == 50
    assert totals == [7, 7, 7, 7, 7, 7, 4, 2, 1, 1]
    assert free_count(sched) == 64


def test_fcfs_a_big_waiting_request_blocks_later_small_ones():
    sched = make_sched(num_blocks=6, block_size=4)
    runner = FakeRunner()
    sched.add_request(make_req("A", 12, base=0, max_tokens=2))  # 3 blocks, then a 4th for decode
    sched.add_request(make_req("B", 16, base=100, max_tokens=1))  # 4 blocks: never fits beside A
    sched.add_request(make_req("C", 3, base=200, max_tokens=1))  # 1 block: would fit, but is behind B
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"A": 12}
    assert [r.request_id for r in sched.waiting] == ["B", "C"]
    so, outs = step(sched, runner)
    assert so.num_scheduled_tokens == {"A": 1}
    assert by_id(outs)["A"].finish_reason == "length"
    # A freed tail first (queue 4, 5, 3, 2, 1, 0): B takes 4 blocks from the head, C the next.
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"B": 16, "C": 3}
    assert block_ids(sched, "B") == [4, 5, 3, 2]
    assert block_ids(sched, "C") == [1]
    assert not sched.waiting


def test_a_running_prefill_chunk_goes_before_waiting_prompts():
    sched = make_sched(budget=16)
    runner = FakeRunner()
    sched.add_request(make_req("A", 40, base=0))
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"A": 16}
    sched.add_request(make_req("B", 8, base=100))
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"A": 16}
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"A": 8, "B": 8}


# ---- preemption --------------------------------------------------------------------------------------


def test_preemption_takes_the_newest_running_request_and_it_resumes_from_its_cache_hit():
    sched = make_sched(num_blocks=7, block_size=4)
    runner = FakeRunner()
    sched.add_request(make_req("A", 8, base=0, max_tokens=3))
    sched.add_request(make_req("B", 8, base=100, max_tokens=10))
    sched.add_request(make_req("C", 8, base=200, max_tokens=10))

    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"A": 8, "B": 8, "C": 8}
    assert [block_ids(sched, r) for r in "ABC"] == [[0, 1], [2, 3], [4, 5]]
    assert free_count(sched) == 1

    # Each needs a block for its 9th token: A takes the last one; B forces C (the newest) out.
    so, outs = step(sched, runner)
    assert so.preempted_req_ids == {"C"}
    assert so.num_scheduled_tokens == {"A": 1, "B": 1}
    assert so.scheduled_new_reqs == []
    assert block_ids(sched, "A") == [0, 1, 6]
    assert block_ids(sched, "B") == [2, 3, 5]  # C's tail block was freed first, so evicted first
    assert block_ids(sched, "C") == []
    assert free_count(sched) == 1
    assert sched.kv_cache_manager.block_pool.free_queue.block_ids() == [4]
    c = sched.requests["C"]
    assert c.status == RequestStatus.PREEMPTED
    assert c.num_computed_tokens == 0
    assert c.output_token_ids == [FILLER]  # kept
    assert c.num_preemptions == 1 and sched.num_preemptions == 1
    assert [r.request_id for r in sched.running] == ["A", "B"]
    assert [r.request_id for r in sched.waiting] == ["C"]
    assert "C" not in {o.req_id for o in outs}

    # C would hit block 4 (its first prompt block, still cached) but needs 2 more blocks: it waits.
    so, outs = step(sched, runner)
    assert so.num_scheduled_tokens == {"A": 1, "B": 1}
    assert by_id(outs)["A"].finish_reason == "length"
    assert sched.kv_cache_manager.block_pool.free_queue.block_ids() == [4, 6, 1, 0]

    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"B": 1, "C": 5}
    (nr,) = so.scheduled_new_reqs
    assert nr.req_id == "C"
    assert nr.num_computed_tokens == 4  # restarts from the prefix-cache hit
    assert nr.output_token_ids == [FILLER]
    assert nr.prompt_token_ids == list(range(200, 208))
    assert nr.block_ids == [4, 6, 1]
    assert c.status == RequestStatus.RUNNING
    assert c.num_computed_tokens == 9
    assert c.num_cached_tokens == 0  # recorded at the first schedule only
    assert c.output_token_ids == [FILLER, FILLER]

    while sched.has_unfinished_requests():
        step(sched, runner)
    assert free_count(sched) == 7
    assert ref_cnts(sched) == [0] * 7


def test_a_request_that_is_itself_the_newest_preempts_itself():
    sched = make_sched(num_blocks=4, block_size=4)
    runner = FakeRunner()
    sched.add_request(make_req("A", 7, base=0, max_tokens=3))
    sched.add_request(make_req("B", 8, base=100, max_tokens=2))
    step(sched, runner)
    assert free_count(sched) == 0
    so, outs = step(sched, runner)
    # A's 8th slot fits its second block; B needs a third block and is the newest, so B goes.
    assert so.num_scheduled_tokens == {"A": 1}
    assert so.preempted_req_ids == {"B"}
    assert free_count(sched) == 2
    assert block_ids(sched, "B") == []
    assert [(o.req_id, o.finish_reason) for o in outs] == [("A", None)]
    # A needs a block for its 9th token and takes one of B's; B's hit alone does not fit (2 > 1).
    so, outs = step(sched, runner)
    assert so.num_scheduled_tokens == {"A": 1}
    assert so.preempted_req_ids == set()
    assert [(o.req_id, o.finish_reason) for o in outs] == [("A", "length")]
    so, outs = step(sched, runner)
    # B's first block is a hit; it recomputes 5 tokens (2nd block and its one output token).
    assert so.num_scheduled_tokens == {"B": 5}
    assert so.scheduled_new_reqs[0].num_computed_tokens == 4
    assert [(o.req_id, o.finish_reason) for o in outs] == [("B", "length")]
    assert sched.requests == {}


def test_preempted_request_goes_to_the_front_of_waiting():
    sched = make_sched(num_blocks=4, block_size=4, max_num_seqs=2)
    runner = FakeRunner()
    sched.add_request(make_req("A", 8, base=0, max_tokens=5))
    sched.add_request(make_req("B", 8, base=100, max_tokens=5))
    sched.add_request(make_req("W", 2, base=300, max_tokens=1))
    step(sched, runner)
    assert [r.request_id for r in sched.waiting] == ["W"]
    so, _ = step(sched, runner)
    assert so.preempted_req_ids == {"B"}
    assert [r.request_id for r in sched.waiting] == ["B", "W"]


def test_without_prefix_caching_a_resumed_request_recomputes_everything():
    sched = make_sched(num_blocks=4, block_size=4, caching=False)
    runner = FakeRunner()
    sched.add_request(make_req("A", 7, base=0, max_tokens=2))
    sched.add_request(make_req("B", 8, base=100, max_tokens=2))
    step(sched, runner)
    step(sched, runner)
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"B": 9}  # no cache: prompt and the kept output token again
    assert so.scheduled_new_reqs[0].num_computed_tokens == 0
    assert so.scheduled_new_reqs[0].output_token_ids == [FILLER]


# ---- n > 1 ---------------------------------------------------------------------------------------


def test_siblings_with_the_same_prompt_share_prompt_blocks_in_the_same_step():
    sched = make_sched(block_size=16)
    runner = FakeRunner()
    prompt = list(range(40))
    sched.add_request(make_req("0_req", prompt))
    sched.add_request(make_req("1_req", prompt))
    so, outs = step(sched, runner)
    assert so.num_scheduled_tokens == {"0_req": 40, "1_req": 8}
    assert block_ids(sched, "0_req") == [0, 1, 2]
    assert block_ids(sched, "1_req") == [0, 1, 3]
    assert ref_cnts(sched)[:5] == [2, 2, 1, 1, 0]
    second = so.scheduled_new_reqs[1]
    assert (second.block_ids, second.num_computed_tokens) == ([0, 1, 3], 32)
    assert sched.requests["1_req"].num_cached_tokens == 32
    assert [(o.req_id, o.num_cached_tokens) for o in outs] == [("0_req", 0), ("1_req", 32)]
    sched.finish_requests(["0_req", "1_req"], RequestStatus.FINISHED_ABORTED)
    assert ref_cnts(sched) == [0] * 64


# ---- bookkeeping ---------------------------------------------------------------------------------


def test_duplicate_request_id_is_rejected():
    sched = make_sched()
    sched.add_request(make_req("A", 5))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_req("A", 5))


def test_empty_schedule_and_stats():
    sched = make_sched(num_blocks=10, block_size=4)
    so = sched.schedule()
    assert so.is_empty and so.num_scheduled_tokens == {}
    runner = FakeRunner()
    sched.add_request(make_req("A", 9, base=0))
    sched.add_request(make_req("B", 9, base=0))
    step(sched, runner)
    st = sched.make_stats()
    assert (st.num_running_reqs, st.num_waiting_reqs) == (2, 0)
    assert st.kv_cache_usage == pytest.approx(0.4)  # A: 3 blocks, B: 2 hits + 1
    assert (st.prefix_cache_queries, st.prefix_cache_hits) == (18, 8)


def test_prefix_cache_stats_count_a_blocked_request_once_at_admission():
    """A waiting request that cannot get blocks is looked up again every step; only its admission counts."""
    sched = make_sched(num_blocks=4, block_size=4)
    runner = FakeRunner()
    a_prompt = list(range(100, 112))
    sched.add_request(make_req("A", a_prompt, max_tokens=3))  # 3 blocks, then a 4th for decode
    sched.add_request(make_req("B", a_prompt[:4] + list(range(500, 508))))  # 1 hit + 2 blocks
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"A": 12}
    so, _ = step(sched, runner)
    so, outs = step(sched, runner)
    assert so.num_scheduled_tokens == {"A": 1}
    assert by_id(outs)["A"].finish_reason == "length"
    st = sched.make_stats()
    assert (st.prefix_cache_queries, st.prefix_cache_hits) == (12, 0)  # B not admitted yet
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"B": 8}
    assert so.scheduled_new_reqs[0].num_computed_tokens == 4
    st = sched.make_stats()
    assert (st.prefix_cache_queries, st.prefix_cache_hits) == (24, 4)


# ---- asynchronous scheduling: steps scheduled before the previous step's tokens are known ----------


def _out(so: SchedulerOutput, tokens: dict[str, int]) -> ModelRunnerOutput:
    req_ids = list(so.num_scheduled_tokens)
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=[[tokens[r]] if r in tokens else [] for r in req_ids])


def test_async_pending_token_is_scheduled_and_a_length_end_is_not():
    sched = make_sched()
    sched.add_request(make_req("A", 5, max_tokens=2))
    so1 = sched.schedule()
    assert so1.num_scheduled_tokens == {"A": 5} and sched.requests["A"].num_pending_tokens == 1
    so2 = sched.schedule()  # before step 1's token is known: A's pending token is its input
    assert so2.num_scheduled_tokens == {"A": 1} and so2.scheduled_cached_reqs.num_computed_tokens == [5]
    assert sched.requests["A"].num_pending_tokens == 2
    so3 = sched.schedule()  # two pending tokens reach max_tokens: nothing more for A
    assert so3.is_empty
    outs = sched.update_from_output(so1, _out(so1, {"A": 11}))
    assert [(o.new_token_ids, o.finish_reason) for o in outs] == [([11], None)]
    outs = sched.update_from_output(so2, _out(so2, {"A": 12}))
    assert [(o.new_token_ids, o.finish_reason) for o in outs] == [([12], "length")]
    assert free_count(sched) == 64 and not sched.has_unfinished_requests()


def test_async_eos_drops_the_step_already_in_flight():
    sched = make_sched()
    sched.add_request(make_req("A", 20, max_tokens=10))
    sched.add_request(make_req("B", 3, base=5000, max_tokens=10))
    so1 = sched.schedule()
    so2 = sched.schedule()
    assert so2.num_scheduled_tokens == {"A": 1, "B": 1}
    outs = by_id(sched.update_from_output(so1, _out(so1, {"A": EOS, "B": 30})))
    assert outs["A"].finish_reason == "stop" and outs["B"].new_token_ids == [30]
    # A's blocks are free at once, though step 2 still computes a token for it; that token is dropped.
    assert block_ids(sched, "A") == []
    so3 = sched.schedule()
    assert so3.finished_req_ids == {"A"} and so3.num_scheduled_tokens == {"B": 1}
    outs = sched.update_from_output(so2, _out(so2, {"A": 99, "B": 31}))
    assert [(o.req_id, o.new_token_ids) for o in outs] == [("B", [31])]
    assert sched.requests["B"].output_token_ids == [30, 31] and sched.requests["B"].num_pending_tokens == 1


def test_async_preempted_request_takes_its_token_in_the_queue_and_resumes_after():
    # 4 blocks of 4 tokens: A (7 prompt tokens) and B (8) hold two each; B's next token needs a third.
    sched = make_sched(num_blocks=4, block_size=4)
    sched.add_request(make_req("A", 7, max_tokens=4))
    sched.add_request(make_req("B", 8, base=5000, max_tokens=4))
    so1 = sched.schedule()
    assert so1.num_scheduled_tokens == {"A": 7, "B": 8}
    so2 = sched.schedule()  # A's pending token fits its blocks; B's does not: B, the newest, is preempted
    assert so2.preempted_req_ids == {"B"} and so2.num_scheduled_tokens == {"A": 1}
    assert sched.requests["B"].status == RequestStatus.PREEMPTED
    # Step 1's token for B lands while B waits in the queue.
    sched.update_from_output(so1, _out(so1, {"A": 40, "B": 50}))
    assert sched.requests["B"].output_token_ids == [50] and sched.requests["B"].num_pending_tokens == 0
    sched.update_from_output(so2, _out(so2, {"A": 41}))
    resumed = []
    while sched.has_unfinished_requests():
        so = sched.schedule()
        resumed += [nr for nr in so.scheduled_new_reqs if nr.req_id == "B"]
        toks = {r: 60 for r in so.num_scheduled_tokens
                if sched.requests[r].num_computed_tokens >= sched.requests[r].num_tokens}
        sched.update_from_output(so, _out(so, toks))
    # Resumed with its token, and a prefix-cache hit on its first block (the second was evicted for A).
    assert [(nr.output_token_ids, nr.num_computed_tokens) for nr in resumed] == [([50], 4)]
    assert free_count(sched) == 4
