"""The GPU model runner end to end on a tiny model: fp32 greedy output identical to the CPU torch_ref path,
CUDA-graph and eager runs identical in bf16, bf16 logprobs close to fp32, graphs actually replayed."""
from __future__ import annotations

import gc

import pytest
import torch

from pagedllm import LLM, SamplingParams, envs
from tiny_models import make_tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

_KV_BYTES = 64 << 20  # the tiny model needs little; keeps several engines in one process cheap


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return make_tiny_model("qwen3", tmp_path_factory.mktemp("tiny") / "qwen3")


def _llm(path, **kw):
    args = dict(model=path, skip_tokenizer_init=True, max_num_seqs=8, max_model_len=256, seed=0)
    args.update(kw)
    return LLM(**args)


def _runner(llm):
    return llm.llm_engine.engine_core.executor.worker.model_runner


def _prompts(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [
        {"prompt_token_ids": torch.randint(3, 380, (int(l),), generator=gen).tolist()}
        for l in torch.randint(2, 40, (n,), generator=gen)
    ]


def _generate(llm, prompts, max_tokens, **params):
    sp = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=m, detokenize=False, **params) for m in max_tokens]
    return llm.generate(prompts, sp, use_tqdm=False)


def _free(llm):
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def _count_graph_steps(runner, tokens=None):
    """Records each step's decode-graph size (0: none replayed), and into ``tokens`` its mixed-graph size."""
    sizes = []
    original = runner._forward

    def spy(b, prev):
        out = original(b, prev)
        sizes.append(out.graph_size)
        if tokens is not None:
            tokens.append(out.graph_tokens)
        return out

    runner._forward = spy
    return sizes


@pytest.fixture(scope="module", params=["qwen3", "gemma3", "llama"])
def any_tiny_path(request, tmp_path_factory):
    return make_tiny_model(request.param, tmp_path_factory.mktemp("tiny") / request.param)


def test_fp32_gpu_greedy_matches_cpu_torch_ref(any_tiny_path):
    # Uneven lengths: the decode batch shrinks through 7, 6, ... so padded graph buckets get used.
    tiny_path = any_tiny_path
    prompts = _prompts(7)
    max_tokens = [4, 9, 13, 17, 21, 24, 30]
    cpu = _llm(tiny_path, device="cpu", attention_backend="torch_ref", dtype="float32")
    ref = [o.outputs[0].token_ids for o in _generate(cpu, prompts, max_tokens)]
    _free(cpu)
    gpu = _llm(tiny_path, device="cuda", dtype="float32", kv_cache_memory_bytes=_KV_BYTES)
    tokens = []
    sizes = _count_graph_steps(_runner(gpu), tokens)
    got = [o.outputs[0].token_ids for o in _generate(gpu, prompts, max_tokens)]
    _free(gpu)
    assert got == ref
    assert {s for s in sizes if s} >= {8, 4, 2, 1}, sizes  # graphs replayed, padding included
    assert any(tokens), tokens  # the prefill ran as a padded mixed-batch graph


def test_fp32_gpu_greedy_with_float8_cache_matches_cpu_torch_ref(tiny_path):
    # The same float8 cache contents on both paths (rounding of GPU-computed keys could in principle land
    # one value on the other side of a float8 rounding step; at this size that is rare).
    prompts = _prompts(5, seed=3)
    max_tokens = [6, 11, 15, 20, 24]
    cpu = _llm(tiny_path, device="cpu", attention_backend="torch_ref", dtype="float32", kv_cache_dtype="fp8")
    ref = [o.outputs[0].token_ids for o in _generate(cpu, prompts, max_tokens)]
    _free(cpu)
    gpu = _llm(tiny_path, device="cuda", dtype="float32", kv_cache_memory_bytes=_KV_BYTES, kv_cache_dtype="fp8")
    assert _runner(gpu).kv_caches[0].dtype == torch.float8_e4m3fn
    got = [o.outputs[0].token_ids for o in _generate(gpu, prompts, max_tokens)]
    _free(gpu)
    assert got == ref


@pytest.mark.parametrize("model", ["qwen3", "gemma3"])
def test_fp32_gpu_greedy_with_qk_norm_and_kv_write_in_one_launch(model, tmp_path):
    # Models with per-head q/k norms run them with the rotary embedding and the K/V store in one launch
    # (kernels/qk_norm_rotary.py) before attention only reads the cache: the CPU path's tokens.
    _assert_fp32_gpu_matches_cpu(make_tiny_model(model, tmp_path / model), seed=6)


def _assert_fp32_gpu_matches_cpu(path, seed: int) -> None:
    """Five prompts of 5-26 greedy tokens: the GPU's float32 tokens equal the CPU torch_ref path's."""
    prompts = _prompts(5, seed=seed)
    max_tokens = [5, 9, 14, 20, 26]
    cpu = _llm(path, device="cpu", attention_backend="torch_ref", dtype="float32")
    ref = [o.outputs[0].token_ids for o in _generate(cpu, prompts, max_tokens)]
    _free(cpu)
    gpu = _llm(path, device="cuda", dtype="float32", kv_cache_memory_bytes=_KV_BYTES)
    got = [o.outputs[0].token_ids for o in _generate(gpu, prompts, max_tokens)]
    _free(gpu)
    assert got == ref


@pytest.mark.parametrize("model", ["llama", "qwen3"])
def test_programmatic_dependent_launch_changes_nothing(model, tmp_path, monkeypatch):
    # PDL (the default on sm90; PAGEDLLM_PDL=0 turns it off) launches the Triton kernels early (graphs
    # included); every kernel waits for its predecessor before touching memory, so bf16 tokens and
    # logprobs must be bit-identical to plain launches.
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    path = make_tiny_model(model, tmp_path / model)
    prompts = _prompts(5, seed=4)
    outs = {}
    for pdl in ("0", "1"):
        monkeypatch.setattr(envs, "PAGEDLLM_PDL", pdl == "1")
        llm = _llm(path, device="cuda", dtype="bfloat16", kv_cache_memory_bytes=_KV_BYTES)
        res = _generate(llm, prompts, [3, 17, 25, 30, 1], logprobs=2)
        outs[pdl] = [(o.outputs[0].token_ids, [list(d.items()) for d in o.outputs[0].logprobs]) for o in res]
        _free(llm)
    assert outs["1"] == outs["0"]


def test_async_scheduling_matches_sync_on_gpu(tiny_path):
    # Seeded sampling with penalties and logprobs reads each request's outputs on the host, and
    # stop tokens end requests that already have a step in flight.
    prompts = _prompts(7, seed=3)
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=8 + 5 * i, repetition_penalty=1.2,
                       logprobs=2, detokenize=False, ignore_eos=True, stop_token_ids=[17, 42] if i % 2 else None)
        for i in range(7)
    ]
    outs = {}
    for mode in ("sync", "async", "async+jit"):
        llm = _llm(tiny_path, device="cuda", dtype="float32", kv_cache_memory_bytes=_KV_BYTES,
                   async_scheduling=mode != "sync", submit_just_in_time=mode == "async+jit")
        res = llm.generate(prompts, params, use_tqdm=False)
        outs[mode] = [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in res]
        if mode == "async+jit":
            # The runner timed its steps on the device, and the core kept their durations per batch size.
            times = llm.llm_engine.engine_core._decode_device_s
            assert times and all(0.0 < t < 1.0 for t in times.values()), times
        _free(llm)
    assert outs["async"] == outs["sync"] == outs["async+jit"]


def test_cuda_graph_and_eager_identical_bf16(tiny_path):
    # Four requests of 16 tokens: the prefill is exactly the 64-token mixed bucket and every decode batch
    # exactly the size-4 bucket, so the graphs and the eager passes run matrix products of the same
    # shapes, and attention with the same tiles: the outputs must match bit for bit.
    gen = torch.Generator().manual_seed(1)
    prompts = [{"prompt_token_ids": torch.randint(3, 380, (16,), generator=gen).tolist()} for _ in range(4)]
    outs = {}
    for eager in (False, True):
        llm = _llm(tiny_path, device="cuda", dtype="bfloat16", enforce_eager=eager, kv_cache_memory_bytes=_KV_BYTES)
        tokens = []
        sizes = _count_graph_steps(_runner(llm), tokens)
        res = _generate(llm, prompts, [40] * 4, logprobs=2)
        outs[eager] = [(o.outputs[0].token_ids, [list(d.items()) for d in o.outputs[0].logprobs]) for o in res]
        assert any(sizes) != eager and (64 in tokens) != eager, (sizes, tokens)
        _free(llm)
    assert outs[False] == outs[True]


def test_bf16_logprobs_close_to_fp32(tiny_path):
    prompts = _prompts(6, seed=2)
    lps = {}
    for dtype in ("float32", "bfloat16"):
        llm = _llm(tiny_path, device="cuda", dtype=dtype, kv_cache_memory_bytes=_KV_BYTES)
        res = _generate(llm, prompts, [1] * 6, prompt_logprobs=0)
        lps[dtype] = torch.tensor(
            [lp for o in res for d, tok in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:]) for lp in [d[tok].logprob]]
        )
        _free(llm)
    assert torch.isfinite(lps["bfloat16"]).all()
    torch.testing.assert_close(lps["bfloat16"], lps["float32"], atol=0.03, rtol=0.0)


def test_start_up_reports_memory_and_phases(tiny_path):
    llm = _llm(tiny_path, device="cuda", dtype="bfloat16", gpu_memory_utilization=0.5)
    worker = llm.llm_engine.engine_core.executor.worker
    assert {"load", "profile", "kv_alloc", "kernel_warmup", "graph_capture"} <= set(worker.startup.phases)
    mem = worker.memory
    assert mem.weights > 0 and mem.kv_cache > 0 and mem.activations > 0
    assert mem.weights + mem.kv_cache + mem.activations <= mem.usable
    _free(llm)


def test_too_little_memory_for_one_sequence_names_the_longest_length_that_fits(tiny_path):
    # A thousandth of the GPU cannot hold even the CUDA context: the profile's error says what took the
    # memory, the longest max_model_len that fits and which settings to change.
    with pytest.raises(ValueError, match=r"not even one sequence of max_model_len 256 fits in GPU memory: .*"
                                         r"The largest max_model_len that fits is \d+; or raise "
                                         r"gpu_memory_utilization \(now 0.001\)"):
        _llm(tiny_path, device="cuda", dtype="bfloat16", gpu_memory_utilization=0.001)


def test_sampled_logits_are_written_into_one_kept_buffer(tiny_path):
    # The rows sampled change every step: their logits go into a buffer of max_num_seqs rows that the
    # runner keeps, by the same product as F.linear, and generation is unchanged by it.
    prompts = _prompts(7, seed=5)
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=6 + 3 * i, logprobs=2,
                             detokenize=False, ignore_eos=True) for i in range(7)]
    outs = {}
    for kept in (True, False):
        llm = _llm(tiny_path, device="cuda", dtype="bfloat16", kv_cache_memory_bytes=_KV_BYTES)
        runner = _runner(llm)
        if kept:
            h = torch.randn(5, runner.model.lm_head.weight.shape[1], dtype=torch.bfloat16, device="cuda")
            logits = runner._logits(h)
            buf = runner._logits_out
            assert buf is not None and buf.shape[0] == runner.max_num_seqs
            assert logits.data_ptr() == buf.data_ptr() and logits.shape[0] == 5
            ref = torch.nn.functional.linear(h, runner.model.lm_head.weight)[:, : logits.shape[1]]
            assert torch.equal(logits, ref)
            assert runner._logits(h[:3]).data_ptr() == buf.data_ptr()
        else:
            runner._logits = lambda hidden: runner.model.compute_logits(hidden, float32=False)
        res = llm.generate(prompts, params, use_tqdm=False)
        outs[kept] = [(o.outputs[0].token_ids, [list(d.items()) for d in o.outputs[0].logprobs]) for o in res]
        _free(llm)
    assert outs[True] == outs[False]
