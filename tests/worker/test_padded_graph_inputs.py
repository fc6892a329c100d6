"""The CUDA graphs' padded static-input paths, run eagerly on the CPU (Triton attention interpreted):
decode batches padded to a request bucket and mixed batches padded to a token bucket must give the
torch_ref path's greedy tokens exactly in float32."""
from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from tiny_models import make_tiny_model

pytest.importorskip("triton", reason="the padded paths belong to the Triton backend")

# The interpreter itself trips a NumPy deprecation on every scalar index; it says nothing about our code.
pytestmark = [
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning"),
    # Triton runs on CPU tensors only in its interpreter, which conftest.py turns on only without a GPU;
    # on a GPU, tests/gpu check the captured graphs themselves.
    pytest.mark.skipif(torch.cuda.is_available(), reason="runs Triton interpreted, which needs a machine without CUDA"),
]


def _runner(llm):
    return llm.llm_engine.engine_core.executor.worker.model_runner


def _result(o):
    c = o.outputs[0]
    prompt_lps = None if o.prompt_logprobs is None else [
        None if d is None else {t: lp.logprob for t, lp in d.items()} for d in o.prompt_logprobs
    ]
    return c.token_ids, prompt_lps


# With 4 request slots (5 with the padding one) every mixed graph carries only last tokens through the
# last layer; with 16 (17), the 16-token graph carries all its tokens and the larger ones prune.
@pytest.mark.slow
@pytest.mark.parametrize(("model", "async_scheduling", "max_num_seqs"),
                         [("llama", False, 4), ("qwen3", True, 4), ("llama", False, 16)])
def test_padded_graph_inputs_match_torch_ref(model, async_scheduling, max_num_seqs, tmp_path):
    # Asynchronous scheduling puts decode tokens still being sampled into mixed steps (filled on the
    # device into the graph's static input ids). A mixed graph carries only each request's last token
    # through the last layer; steps with a prompt-logprobs request, which read every row, run eagerly.
    path = make_tiny_model(model, tmp_path / model)
    gen = torch.Generator().manual_seed(5)
    prompts = [{"prompt_token_ids": torch.randint(3, 380, (n,), generator=gen).tolist()} for n in (9, 3, 21, 14, 5)]
    max_tokens = [6, 9, 4, 11, 7]
    params = [
        SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=m, detokenize=False,
                       prompt_logprobs=2 if i == 2 else None)
        for i, m in enumerate(max_tokens)
    ]
    common = dict(model=path, skip_tokenizer_init=True, device="cpu", dtype="float32", max_num_seqs=max_num_seqs,
                  max_model_len=64, max_num_batched_tokens=40, seed=0, async_scheduling=async_scheduling)
    ref = LLM(attention_backend="torch_ref", **common)
    expected = [_result(o) for o in ref.generate(prompts, params, use_tqdm=False)]

    llm = LLM(attention_backend="triton", **common)
    runner = _runner(llm)
    # What a GPU runner does at start, minus the graphs themselves: replays run the padded forward.
    runner.use_cuda_graphs = True
    runner.capture_cuda_graphs(capture=False)
    assert runner.mixed_graph_runner.sizes == [16, 32, 40]
    assert [runner._mixed_graph_prunes(n) for n in (16, 32)] == [max_num_seqs < 16, True]
    steps = []
    original = runner._forward

    pending_in_mixed = []

    def spy(b, prev):
        out = original(b, prev)
        steps.append((out.graph_size, out.graph_tokens))
        if out.graph_tokens and b.pending_dst is not None and len(b.pending_dst):
            pending_in_mixed.append(len(b.pending_dst))
        return out

    runner._forward = spy
    got = [_result(o) for o in llm.generate(prompts, params, use_tqdm=False)]
    assert [g[0] for g in got] == [e[0] for e in expected]
    # Prompt logprobs (the 21-token prompt, chunked over two padded steps) agree to float32 rounding.
    for (_, g), (_, e) in zip(got, expected):
        assert (g is None) == (e is None)
        if g is not None:
            assert len(g) == len(e) == 21 and g[0] is None and e[0] is None
            for dg, de in zip(g[1:], e[1:]):
                assert dg.keys() == de.keys()
                assert all(abs(dg[t] - de[t]) < 1e-4 for t in dg), (dg, de)
    # Without prompt logprobs every step fits a graph: both families were used, padding included.
    steps.clear()
    assert llm.llm_engine.engine_core.reset_prefix_cache()  # the same prompts again, computed in full
    plain = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=m, detokenize=False) for m in max_tokens]
    assert [_result(o)[0] for o in llm.generate(prompts, plain, use_tqdm=False)] == [e[0] for e in expected]
    assert {t for _, t in steps if t} >= {16, 40}, steps
    assert {s for s, _ in steps if s} >= {4, 2}, steps
    assert all(s or t for s, t in steps), steps
    assert bool(pending_in_mixed) == async_scheduling


def test_eager_steps_prune_like_a_mixed_graph(tmp_path):
    # A graph-safe backend run eagerly (graphs off) keeps the mixed graphs' rule: steps of more tokens than
    # request slots carry one row per slot, padding included, through the last layer; smaller ones all rows.
    path = make_tiny_model("llama", tmp_path / "llama")
    gen = torch.Generator().manual_seed(9)
    prompts = [{"prompt_token_ids": torch.randint(3, 380, (n,), generator=gen).tolist()} for n in (9, 2, 21)]
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=m, detokenize=False) for m in (5, 8, 3)]
    common = dict(model=path, skip_tokenizer_init=True, device="cpu", dtype="float32", max_num_seqs=4,
                  max_model_len=64, max_num_batched_tokens=40, seed=0)
    expected = [o.outputs[0].token_ids for o in LLM(attention_backend="torch_ref", **common).generate(prompts, params)]
    llm = LLM(attention_backend="triton", **common)
    runner = _runner(llm)
    assert not runner.use_cuda_graphs and runner.mixed_graph_reqs == 5
    seen = []
    original = runner._forward

    def spy(b, prev):
        out = original(b, prev)
        seen.append((b.is_pure_decode, b.num_tokens, out.per_request, out.hidden.shape[0]))
        return out

    runner._forward = spy
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected
    mixed = [s for s in seen if not s[0]]
    assert mixed and all(per_request == (tokens > 5) for _, tokens, per_request, _ in mixed), seen
    assert all(rows == 5 for _, _, per_request, rows in mixed if per_request), seen


@pytest.mark.parametrize("compilation_config", [
    {"cudagraph_capture_sizes": [1, 3, 8]},
    {"cudagraph_mode": "FULL_DECODE_ONLY", "max_cudagraph_capture_size": 2},
])
def test_compilation_config_chooses_the_graphs(compilation_config, tmp_path):
    # vLLM's compilation_config picks the decode buckets (sizes above max_num_seqs dropped) and may turn
    # the mixed graphs off; batches without a bucket run eagerly, and every token is torch_ref's.
    path = make_tiny_model("llama", tmp_path / "llama")
    gen = torch.Generator().manual_seed(7)
    prompts = [{"prompt_token_ids": torch.randint(3, 380, (n,), generator=gen).tolist()} for n in (9, 3, 21, 14)]
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=m, detokenize=False) for m in (6, 9, 4, 11)]
    common = dict(model=path, skip_tokenizer_init=True, device="cpu", dtype="float32", max_num_seqs=4,
                  max_model_len=64, max_num_batched_tokens=40, seed=0)
    expected = [o.outputs[0].token_ids for o in LLM(attention_backend="torch_ref", **common).generate(prompts, params)]
    llm = LLM(attention_backend="triton", compilation_config=compilation_config, **common)
    runner = _runner(llm)
    runner.use_cuda_graphs = True
    runner.capture_cuda_graphs(capture=False)
    decode_only = compilation_config.get("cudagraph_mode") == "FULL_DECODE_ONLY"
    assert runner.graph_runner.sizes == ([1, 2] if decode_only else [1, 3])
    assert runner.mixed_graph_runner.sizes == ([] if decode_only else [16, 32, 40])
    steps = []
    original = runner._forward

    def spy(b, prev):
        out = original(b, prev)
        steps.append((b.is_pure_decode, b.num_reqs, out.graph_size, out.graph_tokens))
        return out

    runner._forward = spy
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected
    decodes = {(n, size) for pure, n, size, _ in steps if pure}
    largest = 2 if decode_only else 3
    assert all(size == (runner.graph_runner.bucket_for(n) or 0) for n, size in decodes), decodes
    assert any(n > largest and size == 0 for n, size in decodes) and any(size for _, size in decodes), decodes
    assert any(tokens for _, _, _, tokens in steps) != decode_only
