"""Scheduler: stop checks (EOS, stop tokens, min/max tokens, max_model_len) and requests finished from outside (aborts, stop strings)."""
from __future__ import annotations

from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.scheduler_output import EngineCoreOutput, LogprobsLists, ModelRunnerOutput
from scheduler_harness import EOS, FILLER, FakeRunner, free_count, make_req, make_sched, step

# ---- stop conditions ---------------------------------------------------------------------------------


def run_one(req: Request, script: list[int], **sched_kw) -> tuple[list[int], EngineCoreOutput, Scheduler]:
    """Runs one request to completion; returns all its tokens, its last output and the scheduler."""
    sched = make_sched(**sched_kw)
    runner = FakeRunner({req.request_id: list(script)})
    sched.add_request(req)
    tokens: list[int] = []
    last = None
    for _ in range(100):
        _, outs = step(sched, runner)
        for o in outs:
            tokens.extend(o.new_token_ids)
            last = o
        if not sched.has_unfinished_requests():
            break
    assert last is not None and last.finished
    assert sched.schedule().finished_req_ids == {req.request_id}
    return tokens, last, sched


def test_eos_stops():
    tokens, last, sched = run_one(make_req("r", 5), [10, 11, EOS, 12])
    assert tokens == [10, 11, EOS]
    assert (last.finish_reason, last.stop_reason) == ("stop", None)
    assert free_count(sched) == 64


def test_ignore_eos_keeps_going_until_max_tokens():
    tokens, last, _ = run_one(make_req("r", 5, ignore_eos=True, max_tokens=4), [EOS, EOS, 10, EOS, 11])
    assert tokens == [EOS, EOS, 10, EOS]
    assert last.finish_reason == "length"


def test_stop_token_ids_stop_with_the_token_as_stop_reason():
    tokens, last, _ = run_one(make_req("r", 5, stop_token_ids=[42, 43]), [10, 43, 42])
    assert tokens == [10, 43]
    assert (last.finish_reason, last.stop_reason) == ("stop", 43)


def test_stop_token_ids_apply_even_with_ignore_eos():
    tokens, last, _ = run_one(make_req("r", 5, stop_token_ids=[42], ignore_eos=True), [EOS, 42])
    assert tokens == [EOS, 42]
    assert (last.finish_reason, last.stop_reason) == ("stop", 42)


def test_min_tokens_suppresses_eos_and_stop_tokens():
    tokens, last, _ = run_one(make_req("r", 5, min_tokens=3, stop_token_ids=[42]), [EOS, 42, EOS, 9])
    assert tokens == [EOS, 42, EOS]  # the third token may stop
    assert (last.finish_reason, last.stop_reason) == ("stop", None)


def test_max_tokens_gives_length():
    tokens, last, _ = run_one(make_req("r", 5, max_tokens=3), [])
    assert tokens == [FILLER] * 3
    assert (last.finish_reason, last.stop_reason) == ("length", None)


def test_max_model_len_gives_length():
    tokens, last, _ = run_one(make_req("r", 8, max_tokens=100), [], max_model_len=11)
    assert tokens == [FILLER] * 3  # 8 + 3 = 11 tokens
    assert last.finish_reason == "length"


def test_max_model_len_gives_length_with_max_tokens_none():
    tokens, last, _ = run_one(make_req("r", 8, max_tokens=None), [], max_model_len=10)
    assert tokens == [FILLER] * 2
    assert last.finish_reason == "length"


def test_several_sampled_tokens_in_one_step_stop_at_the_first_stop():
    sched = make_sched()
    sched.add_request(make_req("r", 4, max_tokens=3))
    so = sched.schedule()
    outs = sched.update_from_output(so, ModelRunnerOutput(req_ids=["r"], sampled_token_ids=[[5, 6, 7, 8]]))
    assert [(o.new_token_ids, o.finish_reason) for o in outs] == [([5, 6, 7], "length")]
    sched.add_request(make_req("s", 4, base=50))
    so = sched.schedule()
    lp = LogprobsLists(token_ids=[[5], [EOS], [9]], logprobs=[[-1.0], [-2.0], [-3.0]], ranks=[1, 1, 1])
    outs = sched.update_from_output(
        so, ModelRunnerOutput(req_ids=["s"], sampled_token_ids=[[5, EOS, 9]], logprobs={"s": lp})
    )
    (o,) = outs
    assert o.new_token_ids == [5, EOS] and o.finish_reason == "stop"
    assert o.new_logprobs.ranks == [1, 1] and o.new_logprobs.token_ids == [[5], [EOS]]


def test_partial_prefill_produces_no_output():
    sched = make_sched(budget=8)
    runner = FakeRunner()
    sched.add_request(make_req("r", 20))
    so, outs = step(sched, runner)
    assert outs == [] and so.num_scheduled_tokens == {"r": 8}
    assert sched.requests["r"].num_computed_tokens == 8


# ---- finishing from outside (abort) --------------------------------------------------------------


def test_abort_running_frees_blocks_and_reports_once():
    sched = make_sched(num_blocks=8, block_size=4)
    runner = FakeRunner()
    sched.add_request(make_req("A", 10, base=0))
    sched.add_request(make_req("B", 6, base=100))
    step(sched, runner)
    assert free_count(sched) == 3
    req_a = sched.requests["A"]
    sched.finish_requests("A", RequestStatus.FINISHED_ABORTED)
    assert free_count(sched) == 6
    assert req_a.status == RequestStatus.FINISHED_ABORTED and req_a.finish_reason == "abort"
    assert [r.request_id for r in sched.running] == ["B"]
    sched.finish_requests(["A"], RequestStatus.FINISHED_ABORTED)  # twice is a no-op
    so, _ = step(sched, runner)
    assert so.finished_req_ids == {"A"}
    assert so.num_scheduled_tokens == {"B": 1}
    so, _ = step(sched, runner)
    assert so.finished_req_ids == set()
    assert "A" not in sched.requests


def test_abort_waiting_and_preempted_requests():
    sched = make_sched(num_blocks=4, block_size=4)
    runner = FakeRunner()
    sched.add_request(make_req("A", 7, base=0, max_tokens=5))
    sched.add_request(make_req("B", 8, base=100, max_tokens=5))
    sched.add_request(make_req("W", 3, base=200, max_tokens=5))
    step(sched, runner)
    so, _ = step(sched, runner)
    assert so.preempted_req_ids == {"B"}
    assert [r.request_id for r in sched.waiting] == ["B", "W"]
    sched.finish_requests(["B", "W", "nope"], RequestStatus.FINISHED_ABORTED)
    assert not sched.waiting
    assert sched.get_num_unfinished_requests() == 1
    assert free_count(sched) == 2
    so, _ = step(sched, runner)
    assert so.finished_req_ids == {"B", "W"}
    assert so.num_scheduled_tokens == {"A": 1}


def test_abort_between_schedule_and_update_drops_the_sampled_token():
    sched = make_sched()
    runner = FakeRunner()
    sched.add_request(make_req("A", 5))
    sched.add_request(make_req("B", 5, base=50))
    so = sched.schedule()
    ro = runner.execute(so)
    sched.finish_requests("A", RequestStatus.FINISHED_ABORTED)
    outs = sched.update_from_output(so, ro)
    assert [o.req_id for o in outs] == ["B"]
    assert sched.schedule().finished_req_ids == {"A"}
    assert free_count(sched) == 63


def test_finish_by_stop_string_records_the_reason():
    sched = make_sched()
    runner = FakeRunner()
    sched.add_request(make_req("A", 5))
    step(sched, runner)
    req = sched.requests["A"]
    sched.finish_requests("A", RequestStatus.FINISHED_STOPPED, "###")
    assert (req.finish_reason, req.stop_reason) == ("stop", "###")
    assert free_count(sched) == 64
