"""Expert parallelism across data-parallel engine cores: the all-to-all experts over cores that hold different
tokens (none, too), the process groups of K cores' ranks, and the sizes refused before anything loads."""
from __future__ import annotations

import os
import signal
import socket
import time

import psutil
import pytest
import torch
import torch.multiprocessing as mp
from parallel_cases import COMMON, GREEDY, prompts
from tiny_models import make_tiny_model

from pagedllm import LLM, SamplingParams
from pagedllm.engine.core_client import EngineDeadError
from pagedllm.distributed.parallel_state import (
    destroy_model_parallel, get_ep_group, get_pp_group, get_tp_group, get_world_group, init_model_parallel,
)
from pagedllm.layers.fused_moe import fused_experts_ref, select_experts
from pagedllm.layers.fused_moe.expert_parallel import expert_parallel_experts

EXPERTS, HIDDEN, INTER, TOP_K = 8, 24, 16, 3
SHAPES = {"qwen3_moe": dict(num_hidden_layers=3, vocab_size=383), "mixtral": dict(num_hidden_layers=3, vocab_size=383)}
# Tokens of core 0 and core 1 per case: one core without any, fewer tokens than a core's ranks, uneven sizes.
CASES = ((0, 5), (7, 0), (1, 2), (9, 33), (0, 0))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _weights():
    g = torch.Generator().manual_seed(0)
    return torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g), torch.randn(EXPERTS, HIDDEN, INTER, generator=g)


def _tokens(core: int, n: int):
    g = torch.Generator().manual_seed(100 * core + n)
    x = torch.randn(n, HIDDEN, generator=g)
    logits = torch.randn(n, EXPERTS, generator=g)
    if n > 4:
        logits[:4, 5] = 9.0  # some tokens agree on an expert
    weights, ids = select_experts(logits, TOP_K, renormalize=True)
    return x, weights, ids


def _core_rank(rank: int, dp: int, tp: int, port: int, results) -> None:
    core, local = divmod(rank, tp)
    init_model_parallel(tp, 1, local, f"tcp://127.0.0.1:{port}", enable_expert_parallel=True,
                        data_parallel_size=dp, data_parallel_rank=core)
    try:
        ep, tp_group = get_ep_group(), get_tp_group()
        assert (ep.world_size, ep.rank_in_group, tp_group.world_size) == (dp * tp, rank, tp)
        assert get_world_group().world_size == dp * tp and get_pp_group().world_size == 1
        assert tp_group.ranks == list(range(core * tp, (core + 1) * tp))
        w13, w2 = _weights()
        per_rank = EXPERTS // (dp * tp)
        local_ids = slice(rank * per_rank, (rank + 1) * per_rank)
        for case in CASES:
            x, weights, ids = _tokens(core, case[core])

            def run(rows, w, ids_):
                return fused_experts_ref(rows, w13[local_ids], w2[local_ids], w, ids_)

            got = expert_parallel_experts(x, weights, ids, ep, per_rank, run, token_group=tp_group)
            # The reference over both cores' tokens end to end: every expert sees the same rows in the same order.
            both = [_tokens(c, case[c]) for c in range(dp)]
            ref = fused_experts_ref(torch.cat([b[0] for b in both]), w13, w2, torch.cat([b[1] for b in both]),
                                    torch.cat([b[2] for b in both]))
            start = sum(case[:core])
            results[(rank, case)] = (torch.equal(got, ref[start:start + case[core]]),
                                     torch.allclose(got, fused_experts_ref(x, w13, w2, weights, ids), atol=1e-5))
    finally:
        destroy_model_parallel()


@pytest.mark.parametrize("tp", [1, 2])
def test_cores_with_different_tokens_get_the_reference_bit_for_bit(tp):
    # Two cores (x tp ranks each) of 8 / (2 tp) experts per rank; each core brings its own tokens, zero included.
    # Every rank leaves with its core's tokens' outputs, equal bit for bit to the one-process reference over both
    # cores' tokens laid end to end, and to the reference over its own core's tokens.
    results = mp.Manager().dict()
    mp.spawn(_core_rank, args=(2, tp, _port(), results), nprocs=2 * tp)
    assert dict(results) == {(r, c): (True, True) for r in range(2 * tp) for c in CASES}


def test_dp_times_tp_not_dividing_the_experts_is_refused_before_loading(tmp_path):
    path = make_tiny_model("mixtral", tmp_path / "m", num_hidden_layers=1, num_local_experts=6, vocab_size=383)
    with pytest.raises(ValueError, match="6 experts are not divisible by data_parallel_size 2 x "
                                         "tensor_parallel_size 2 = 4 expert-parallel ranks"):
        LLM(model=path, dtype="float32", device="cpu", skip_tokenizer_init=True, data_parallel_size=2,
            tensor_parallel_size=2, enable_expert_parallel=True)


def test_pipeline_stages_with_dp_and_ep_are_refused_before_any_process_starts(tmp_path):
    with pytest.raises(NotImplementedError, match="pipeline_parallel_size 2 with data_parallel_size 2 and "
                                                  "enable_expert_parallel is not implemented"):
        LLM(model=str(tmp_path), dtype="float32", device="cpu", data_parallel_size=2, pipeline_parallel_size=2,
            enable_expert_parallel=True)


def test_async_scheduling_with_dp_and_ep_is_refused_before_any_core_starts(tmp_path):
    # The cores step in lockstep, one synchronous model call each per step.
    path = make_tiny_model("mixtral", tmp_path / "m", num_hidden_layers=1, vocab_size=383)
    with pytest.raises(NotImplementedError, match="async_scheduling with data_parallel_size 2 and "
                                                  "enable_expert_parallel is not implemented"):
        LLM(model=path, dtype="float32", device="cpu", skip_tokenizer_init=True, data_parallel_size=2,
            enable_expert_parallel=True, async_scheduling=True)


def test_dp_and_ep_on_a_dense_model_is_refused(tmp_path):
    path = make_tiny_model("llama", tmp_path / "m", num_hidden_layers=1)
    with pytest.raises(ValueError, match="data_parallel_size 2 .* this model has no experts"):
        LLM(model=path, dtype="float32", device="cpu", skip_tokenizer_init=True, data_parallel_size=2,
            enable_expert_parallel=True)


def test_dp2_ep_greedy_tokens_equal_one_process(tmp_path):
    # Two engine cores of one rank each share the experts (8 of 16 each). Every case gives one process's tokens:
    # prompts of different lengths over both cores; one core whose only request ends after 2 tokens while the
    # other's runs 14 (its steps in between are the empty MoE-only ones); a single request, so that one core never
    # has any; two completions per prompt.
    path = make_tiny_model("qwen3_moe", tmp_path / "m", **SHAPES["qwen3_moe"])
    ids = prompts()
    short_long = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (2, 14)]
    two = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, n=2)
    cases = [(ids, GREEDY), (ids[2:4], short_long), (ids[3:4], GREEDY), (ids[:3], two)]
    want, _ = _generate_all(LLM(model=path, **COMMON), cases)
    got, routed = _generate_all(LLM(model=path, data_parallel_size=2, enable_expert_parallel=True, **COMMON), cases)
    assert got == want
    # Requests routed to each core by the end of each case: the short and the long request on different cores.
    assert routed[1][0] - routed[0][0] == 1 and routed[1][1] - routed[0][1] == 1, routed
    assert sum(routed[2]) - sum(routed[1]) == 1, routed


def _generate_all(llm: LLM, cases) -> tuple[list, list]:
    client = llm.llm_engine.dp_client
    try:
        outs, routed = [], []
        for prompt_ids, params in cases:
            res = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False)
            outs.append([[list(c.token_ids) for c in o.outputs] for o in res])
            routed.append(list(client.router.num_routed) if client is not None else None)
        return outs, routed
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.slow  # four worker processes under two cores
def test_dp2_tp2_ep_greedy_tokens_equal_one_process(tmp_path):
    # 2 cores x 2 tensor ranks: 4 expert-parallel ranks of 2 experts each (Mixtral, top-2 of 8); chunked prefill
    # (16-token steps) gives the cores steps of different sizes.
    path = make_tiny_model("mixtral", tmp_path / "m", **SHAPES["mixtral"])
    ids = prompts()
    kwargs = dict(max_num_batched_tokens=16)
    want, _ = _generate_all(LLM(model=path, **COMMON, **kwargs), [(ids, GREEDY)])
    got, _ = _generate_all(LLM(model=path, data_parallel_size=2, tensor_parallel_size=2, enable_expert_parallel=True,
                               **COMMON, **kwargs), [(ids, GREEDY)])
    assert got == want


def test_killed_core_ends_every_request_fast_and_leaves_no_process(tmp_path):
    # The surviving core would wait for the dead one in its next MoE layer: the front-end fails every request at
    # once, naming the dead core, and takes the survivor down too.
    path = make_tiny_model("qwen3_moe", tmp_path / "m", **SHAPES["qwen3_moe"])
    llm = LLM(model=path, data_parallel_size=2, enable_expert_parallel=True, **COMMON)
    pids = llm.llm_engine.dp_client.pids
    try:
        os.kill(pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match="data-parallel engine core 1"):
            llm.generate([{"prompt_token_ids": p} for p in prompts()],
                         SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True), use_tqdm=False)
        assert time.monotonic() - t0 < 10
    finally:
        llm.llm_engine.shutdown()
    assert [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE] == []
