"""Float8 experts: ``MoEExperts.quantize_fp8`` (run by ``quantization="fp8"``), the CPU path against the
experts dequantized through float32, greedy decoding of tiny MoE models with float8 experts against the
same models with those experts dequantized, and the Triton grouped GEMM over float8 weights (interpreter)."""
from __future__ import annotations

import pytest
import torch
from tiny_models import make_tiny_model

from pagedllm import LLM, SamplingParams
from pagedllm.kernels.moe import fused_experts
from pagedllm.layers.fused_moe import MoEExperts, fused_experts_ref, select_experts
from pagedllm.layers.quantization.fp8 import FP8_MAX


def _dequantized(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:  # [E, N, K] float8, [E, N] -> float32
    return q.float() * scale[:, :, None]


def _fp8_experts(num_experts: int, hidden: int, inter: int, seed: int):
    """Random experts rounded to float8 rows (scales as ``quantize_fp8`` gives them)."""
    torch.manual_seed(seed)
    moe = MoEExperts(num_experts, 2, hidden, inter, renormalize=True, params_dtype=torch.float32)
    moe.w13_weight.data.normal_(0, hidden**-0.5)
    moe.w2_weight.data.normal_(0, inter**-0.5)
    return moe


def test_quantize_fp8_rows_and_scales():
    moe = _fp8_experts(4, 32, 16, seed=0)
    full13, full2 = moe.w13_weight.data.clone(), moe.w2_weight.data.clone()
    moe.quantize_fp8()
    assert moe.w13_weight.dtype == moe.w2_weight.dtype == torch.float8_e4m3fn
    assert moe.w13_weight_scale.shape == (4, 32) and moe.w2_weight_scale.shape == (4, 32)
    for q, s, full in ((moe.w13_weight, moe.w13_weight_scale, full13), (moe.w2_weight, moe.w2_weight_scale, full2)):
        # each row's largest magnitude maps to the float8 maximum, and the round trip stays within e4m3's step
        torch.testing.assert_close(s, full.abs().amax(dim=-1) / FP8_MAX)
        torch.testing.assert_close(_dequantized(q, s), full, atol=0.0, rtol=2**-3)
        assert not torch.equal(_dequantized(q, s), full)  # rounded, not a copy


def test_cpu_fp8_experts_match_dequantized_reference():
    moe = _fp8_experts(6, 32, 24, seed=1)
    moe.quantize_fp8()
    g = torch.Generator().manual_seed(2)
    x, logits = torch.randn(9, 32, generator=g), torch.randn(9, 6, generator=g)
    got = moe(x, logits)
    weights, ids = select_experts(logits, 2, True)
    want = fused_experts_ref(x, _dequantized(moe.w13_weight, moe.w13_weight_scale),
                             _dequantized(moe.w2_weight, moe.w2_weight_scale), weights, ids)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                         use_tqdm=False)]


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_greedy_fp8_experts_match_dequantized_experts(kind, tmp_path):
    path = make_tiny_model(kind, tmp_path / kind)
    llm = LLM(model=path, dtype="float32", device="cpu", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 22,
              max_model_len=128, quantization="fp8")
    model = llm.llm_engine.engine_core.executor.worker.model_runner.model
    experts = [m for m in model.modules() if isinstance(m, MoEExperts)]
    assert experts and all(m.w13_weight.dtype == torch.float8_e4m3fn for m in experts)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 100, (n,), generator=g).tolist() for n in (3, 11)]
    fp8_tokens = _greedy(llm, prompts)
    for m in experts:  # the same experts, dequantized: the float32 path with no scales
        m.w13_weight = torch.nn.Parameter(_dequantized(m.w13_weight, m.w13_weight_scale), requires_grad=False)
        m.w2_weight = torch.nn.Parameter(_dequantized(m.w2_weight, m.w2_weight_scale), requires_grad=False)
        m.w13_weight_scale = m.w2_weight_scale = None
    assert _greedy(llm, prompts) == fp8_tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens,top_k,num_experts", [(5, 2, 4), (17, 1, 3)])
def test_triton_fp8_grouped_gemm_matches_reference(dtype, tokens, top_k, num_experts):
    hidden, inter = 32, 24  # inter not a multiple of the column tile: masked edges
    moe = _fp8_experts(num_experts, hidden, inter, seed=tokens)
    moe.quantize_fp8()
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    weights, ids = select_experts(torch.randn(tokens, num_experts, generator=g), top_k, renormalize=top_k > 1)
    config = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=1, num_warps=4, num_stages=2)
    got = fused_experts(x, moe.w13_weight, moe.w2_weight, weights, ids, config,
                        w13_scale=moe.w13_weight_scale, w2_scale=moe.w2_weight_scale)
    want = fused_experts_ref(x, moe.w13_weight, moe.w2_weight, weights, ids, "silu",
                             moe.w13_weight_scale, moe.w2_weight_scale)
    tol = dict(atol=2e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-3, rtol=3e-3)
    torch.testing.assert_close(got, want, **tol)


def test_triton_fp8_rejects_bad_scales():
    moe = _fp8_experts(2, 16, 16, seed=3)
    moe.quantize_fp8()
    x = torch.randn(2, 16)
    weights, ids = select_experts(torch.randn(2, 2), 1, False)
    with pytest.raises(ValueError, match=r"expert weight scales must be contiguous float32 of shape \(2, 32\)"):
        fused_experts(x, moe.w13_weight, moe.w2_weight, weights, ids, w13_scale=moe.w13_weight_scale[:, :16].contiguous(),
                      w2_scale=moe.w2_weight_scale)


def test_fp8_checkpoint_experts_equal_quantizing_at_load(tmp_path):
    """A float8 checkpoint whose experts are stored per expert with their [N, 1] scales loads into the stacked
    float8 parameters; quantizing its source at load gives the same rows and scales, so the same numbers."""
    from tiny_models import compressed_tensors_fp8_config, make_fp8_checkpoint

    src = make_tiny_model("qwen3_moe", tmp_path / "src")
    path = make_fp8_checkpoint(src, str(tmp_path / "fp8"), compressed_tensors_fp8_config("channel"), per_channel=True)
    kw = dict(dtype="float32", device="cpu", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 22, max_model_len=128)
    stored, at_load = LLM(model=path, **kw), LLM(model=src, quantization="fp8", **kw)
    pairs = []
    for llm in (stored, at_load):
        model = llm.llm_engine.engine_core.executor.worker.model_runner.model
        pairs.append([m for m in model.modules() if isinstance(m, MoEExperts)])
    assert pairs[0] and all(m.w13_weight.dtype == torch.float8_e4m3fn for m in pairs[0])
    for a, b in zip(*pairs):
        for name in ("w13_weight", "w2_weight"):
            assert torch.equal(getattr(a, name).view(torch.uint8), getattr(b, name).view(torch.uint8))
            assert torch.equal(getattr(a, name + "_scale"), getattr(b, name + "_scale"))
    prompts = [[5, 9, 17, 3], list(range(20, 33))]
    assert _greedy(stored, prompts) == _greedy(at_load, prompts)


def test_fp8_checkpoint_expert_scale_of_wrong_length_is_refused():
    from pagedllm.layers.linear import default_linear_method
    from pagedllm.layers.quantization.fp8 import Fp8LinearMethod

    with default_linear_method(lambda: Fp8LinearMethod(serialized=True)):
        moe = MoEExperts(2, 1, 16, 8, renormalize=False, params_dtype=torch.float32)
    assert moe.w13_weight.dtype == torch.float8_e4m3fn and moe.w2_weight_scale.shape == (2, 16)
    with pytest.raises(ValueError, match="expert 1 w1 weight_scale has 5 values; its projection has 8 rows"):
        moe.weight_loader(moe.w13_weight_scale, torch.ones(5, 1), "w1", 1)
