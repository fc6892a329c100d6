"""Pipeline parallelism (and pipeline x tensor) in real worker processes over gloo: the same tokens as one process."""
from __future__ import annotations

import pytest
from parallel_cases import COMMON, GREEDY, generate, make_edge_model, prompts

from pagedllm import LLM, SamplingParams
from pagedllm.distributed.pipeline import stage_layer_range


def test_stage_layer_ranges_are_contiguous_and_cover_every_layer():
    for layers in range(1, 12):
        for pp in range(1, layers + 1):
            ranges = [stage_layer_range(layers, r, pp) for r in range(pp)]
            assert ranges[0][0] == 0 and ranges[-1][1] == layers
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
            sizes = [e - s for s, e in ranges]
            assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1
            # The last stage, which also holds the LM head, never gets an extra layer.
            assert sizes[-1] == min(sizes)
    with pytest.raises(ValueError, match="3 layers cannot be split over pipeline_parallel_size 4"):
        stage_layer_range(3, 0, 4)


def _generate_watching_batches(path: str, prompt_ids) -> tuple[list[list[list[int]]], list[list[set[str]]]]:
    """Greedy tokens under PP=2, and at each output taken the requests of every batch then in flight
    (the ones sent to the workers and not yet answered)."""
    llm = LLM(model=path, **{**COMMON, "pipeline_parallel_size": 2})
    core = llm.llm_engine.engine_core
    executor, take = core.executor, core.executor.take_output
    in_flight: list[list[set[str]]] = []

    def take_watching():
        assert len(executor._pending) == len(core._batches)  # every batch the core holds went to the workers
        in_flight.append([set(so.num_scheduled_tokens) for so in core._batches])
        return take()

    executor.take_output = take_watching
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], GREEDY, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    return [[list(c.token_ids) for c in o.outputs] for o in outs], in_flight


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_pp2_greedy_tokens_equal_one_process_with_two_batches_in_flight(kind, tmp_path):
    path = make_edge_model(kind, tmp_path / kind)
    ids = prompts()
    tokens, in_flight = _generate_watching_batches(path, ids)
    assert tokens == generate(path, ids)
    # Each stage had a batch at every take but the last (when the other half of the requests had ended):
    # each batch half of the six requests, ten tokens each, and no request in both batches.
    assert [len(batches) for batches in in_flight] == [2] * 19 + [1]
    assert all(len(b) == 3 for batches in in_flight for b in batches)
    assert all(not batches[0] & batches[1] for batches in in_flight[:-1])


@pytest.mark.parametrize("kind", ["qwen3", pytest.param("gemma3", marks=pytest.mark.slow)])
def test_tp2_x_pp2_greedy_tokens_equal_one_process(kind, tmp_path):
    path = make_edge_model(kind, tmp_path / kind)
    ids = prompts()
    assert generate(path, ids, tensor_parallel_size=2, pipeline_parallel_size=2,
                    max_num_batched_tokens=16) == generate(path, ids)


def _logprobs(path: str, **kwargs) -> list[tuple[list[int], list[dict[int, float]], list[dict[int, float]]]]:
    llm = LLM(model=path, **{**COMMON, **kwargs})
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts()[1:4]], params, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    as_floats = lambda rows: [{t: lp.logprob for t, lp in row.items()} for row in rows]  # noqa: E731
    return [(list(o.outputs[0].token_ids), as_floats(o.outputs[0].logprobs), as_floats(o.prompt_logprobs[1:]))
            for o in outs]


def test_logprobs_and_prompt_logprobs_under_tp2_x_pp2_match_one_process(tmp_path):
    path = make_edge_model("llama", tmp_path / "llama")
    one, split = _logprobs(path), _logprobs(path, tensor_parallel_size=2, pipeline_parallel_size=2)
    for (ids1, lp1, plp1), (ids2, lp2, plp2) in zip(one, split, strict=True):
        assert ids1 == ids2
        for a, b in zip(lp1 + plp1, lp2 + plp2, strict=True):
            assert a.keys() == b.keys()
            assert all(abs(a[t] - b[t]) < 1e-4 for t in a)
