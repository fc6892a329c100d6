"""Float8 weight quantization (``quantization="fp8"``): the per-row quantizer, its Triton kernel, the float8
GEMV, the scaled-product convention, and a model quantized at load against its 16/32-bit self."""
from __future__ import annotations

import pytest
import torch
from tiny_models import make_tiny_model

from pagedllm import LLM, SamplingParams
from pagedllm.kernels.fp8_quant import FP8_MAX, MIN_SCALE
from pagedllm.layers.quantization import quantize_model
from pagedllm.layers.quantization.fp8 import FP8_DTYPE, Fp8LinearMethod, fp8_linear_ref, quantize_rows_ref

pytestmark = [pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")]

_ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if _ON_GPU else "cpu"


def _exact_rows(m: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows whose quantization rounds nothing: float8 values times a power-of-two scale, each row reaching
    +-448 once. Returns (x [m, k] float16, expected float8 rows, expected scales [m, 1])."""
    gen = torch.Generator().manual_seed(seed)
    qf = (torch.randn(m, k, generator=gen) * 60).clamp(-FP8_MAX, FP8_MAX)
    qf[torch.arange(m), torch.randint(0, k, (m,), generator=gen)] = FP8_MAX * torch.where(torch.arange(m) % 2 == 0, 1.0, -1.0)
    q = qf.to(FP8_DTYPE)
    scales = 2.0 ** torch.randint(-12, -6, (m, 1), generator=gen).float()
    return (q.float() * scales).half(), q, scales


def test_reference_quantizer_bounds_the_error_and_keeps_zero_rows() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 200, generator=gen) * torch.tensor([1e-3, 1.0, 30.0, 1e3, 1.0, 0.0])[:, None]
    q, s = quantize_rows_ref(x)
    assert q.dtype == FP8_DTYPE and s.shape == (6, 1) and s.dtype == torch.float32
    torch.testing.assert_close(s[:5, 0], x[:5].abs().amax(-1) / FP8_MAX)
    assert s[5, 0] == MIN_SCALE and not q[5].float().any()
    # e4m3 keeps 3 mantissa bits: rounding to nearest errs by at most 2^-4 of a normal value, and by half
    # the smallest subnormal step (2^-10 of the scale) below the normal range.
    err = (q.float() * s - x).abs()
    assert (err <= x.abs() * 2.0**-4 + s * 2.0**-10 + 1e-12).all()


@pytest.mark.parametrize("whole_row_max", [16384, 512])  # rows read once; rows past 512 in two passes of 1024
@pytest.mark.parametrize(("m", "k"), [(1, 64), (5, 1300), (3, 2048)])
def test_triton_quantizer_matches_the_reference(m: int, k: int, whole_row_max: int, monkeypatch) -> None:
    from pagedllm.kernels import fp8_quant, launch

    monkeypatch.setattr(launch, "WHOLE_ROW_MAX", whole_row_max)
    x, q_exp, s_exp = _exact_rows(m, k, seed=m * k)
    q, s = fp8_quant.quantize_rows(x.to(DEVICE))
    assert q.shape == (m, k) and q.dtype == FP8_DTYPE and s.shape == (m, 1)
    torch.testing.assert_close(s.cpu(), s_exp, atol=0, rtol=0)
    assert torch.equal(q.cpu().view(torch.uint8), q_exp.view(torch.uint8))
    ref_q, ref_s = quantize_rows_ref(x)
    assert torch.equal(ref_q.view(torch.uint8), q_exp.view(torch.uint8)) and torch.equal(ref_s, s_exp)


@pytest.mark.parametrize(("n", "k", "bias"), [(64, 1024, False), (48, 512, True)])
def test_gemv_reads_float8_weights_with_row_scales(n: int, k: int, bias: bool) -> None:
    from pagedllm.kernels import gemv

    gen = torch.Generator().manual_seed(n + k)
    w_q, w_s = quantize_rows_ref(torch.randn(n, k, generator=gen) * k**-0.5)
    x = torch.randn(1, k, generator=gen).half()
    b = torch.randn(n, generator=gen).half() if bias else None
    y = gemv.gemv(x.to(DEVICE), w_q.to(DEVICE), None if b is None else b.to(DEVICE), scale=w_s.reshape(-1).to(DEVICE))
    ref = (x.float() @ w_q.float().t()) * w_s.reshape(1, -1) + (b.float() if bias else 0.0)
    assert y.shape == (1, n) and y.dtype == torch.float16
    torch.testing.assert_close(y.float().cpu(), ref, atol=4e-3, rtol=2e-3)


def test_scaled_mm_convention_is_the_reference_product() -> None:
    """torch._scaled_mm (the CUDA path) multiplies row i by scale_a[i] and column j by scale_b[j]. CUDA's
    row-wise scaling returns bf16 only (one rounding of |y| ~ 1-10); the CPU's returns float32."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(32, 96, generator=gen)
    w_q, w_s = quantize_rows_ref(torch.randn(48, 96, generator=gen))
    q, s = quantize_rows_ref(x)
    out_dtype, tol = (torch.bfloat16, 1e-2) if _ON_GPU else (torch.float32, 1e-5)
    y = torch._scaled_mm(q.to(DEVICE), w_q.to(DEVICE).t(), scale_a=s.to(DEVICE), scale_b=w_s.view(1, -1).to(DEVICE),
                         out_dtype=out_dtype)
    torch.testing.assert_close(y.float().cpu(), fp8_linear_ref(x, w_q, w_s.reshape(-1), None), atol=tol, rtol=tol)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    return make_tiny_model("llama", str(tmp_path_factory.mktemp("fp8-llama")))


def _llm(path: str, **kw) -> LLM:
    return LLM(model=path, dtype="float32", device="cpu", kv_cache_memory_bytes=1 << 22, max_model_len=128,
               skip_tokenizer_init=True, **kw)


def test_model_quantized_at_load_stays_close_to_its_float32_self(tiny_llama: str) -> None:
    full, quant = _llm(tiny_llama), _llm(tiny_llama, quantization="fp8")
    runner = quant.llm_engine.engine_core.executor.worker.model_runner
    linears = [m for m in runner.model.modules() if isinstance(getattr(m, "quant_method", None), Fp8LinearMethod)]
    assert len(linears) == 4 * 2  # qkv, o, gate_up, down in each of the 2 layers
    assert all(m.weight.dtype == FP8_DTYPE and m.weight_scale.shape == (m.weight.shape[0],) for m in linears)
    assert runner.model.lm_head.weight.dtype == torch.float32  # the head stays in the model's dtype

    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=20)
    prompts = [{"prompt_token_ids": list(range(3 + i, 40 + 7 * i))} for i in range(4)]
    for a, b in zip(full.generate(prompts, params, use_tqdm=False), quant.generate(prompts, params, use_tqdm=False)):
        top_full = a.outputs[0].logprobs[0]
        top_quant = b.outputs[0].logprobs[0]
        # The same distribution to within float8's ~3% per weight: most of the top 20 agree, with close values.
        shared = set(top_full) & set(top_quant)
        assert len(shared) >= 14
        assert max(abs(top_full[t].logprob - top_quant[t].logprob) for t in shared) < 0.1


def test_quantize_model_refuses_unknown_methods_and_skips_odd_shapes() -> None:
    from pagedllm.layers.linear import ReplicatedLinear

    model = torch.nn.ModuleDict({"ok": ReplicatedLinear(32, 16), "odd": ReplicatedLinear(24, 10)})
    for m in model.values():
        m.weight.data.normal_()
    with pytest.raises(ValueError, match="quantization must be one of fp8, int8, int4, awq, gptq, compressed-tensors, modelopt, gguf; got 'int3'"):
        quantize_model(model, "int3")
    assert quantize_model(model, "fp8") == 1
    assert model["ok"].weight.dtype == FP8_DTYPE and model["odd"].weight.dtype == torch.float32
    x = torch.randn(3, 32)
    torch.testing.assert_close(model["ok"](x), fp8_linear_ref(x, model["ok"].weight, model["ok"].weight_scale, None))


def test_engine_args_name_the_bad_quantization() -> None:
    from pagedllm.engine_args import EngineArgs

    with pytest.raises(ValueError, match="quantization must be one of fp8, int8, int4, awq, gptq, compressed-tensors, modelopt, gguf, "
                                         "awq_marlin, gptq_marlin, moe_wna16 or None; got 'bitsandbytes'"):
        EngineArgs(model="x", quantization="bitsandbytes")._check()


@pytest.mark.parametrize(("m", "n", "k", "split", "bias"), [(5, 64, 256, 1, False), (16, 96, 512, 2, True),
                                                            (3, 64, 1024, None, True), (7, 64, 2048, None, False)])
def test_skinny_gemm_reads_float8_weights_with_row_scales(m: int, n: int, k: int, split: int | None, bias: bool) -> None:
    """Given tiles, and (split None) the float8 tiles of the default rule: 512 deep, or 256 deep split 4 ways."""
    from pagedllm.kernels import skinny_gemm as sg

    gen = torch.Generator().manual_seed(m * n)
    w_q, w_s = quantize_rows_ref(torch.randn(n, k, generator=gen) * k**-0.5)
    x = torch.randn(m, k, generator=gen).half()
    b = torch.randn(n, generator=gen).half() if bias else None
    cfg = sg.GemmConfig(16, 32, 64, 4, 2, split) if split else None
    if split is None:
        assert sg.default_config(m, n, k) == (
            sg.GemmConfig(16, 32, 512, 4, 3) if k <= 1024 else sg.GemmConfig(16, 32, 256, 4, 3, 4))
    y = sg.skinny_gemm(x.to(DEVICE), w_q.to(DEVICE), None if b is None else b.to(DEVICE), config=cfg,
                       scale=w_s.reshape(-1).to(DEVICE))
    ref = (x.float() @ w_q.float().t()) * w_s.reshape(1, -1) + (b.float() if bias else 0.0)
    assert y.shape == (m, n) and y.dtype == torch.float16
    torch.testing.assert_close(y.float().cpu(), ref, atol=4e-3, rtol=2e-3)


@pytest.mark.parametrize(("m", "cfg"), [(5, (16, 64, 128, 4, 2, 1)), (16, (16, 64, 64, 4, 2, 2)),
                                        (37, (64, 64, 128, 4, 2, 1)), (20, (32, 128, 64, 4, 2, 4))])
def test_swapped_tiles_read_float8_weights_as_the_left_operand(m: int, cfg: tuple) -> None:
    """Weight rows as the product's left operand (``swap_ab``): ragged rows, K splits and the column scales
    give what the reference gives."""
    from pagedllm.kernels import skinny_gemm as sg

    n, k = 256, 512
    gen = torch.Generator().manual_seed(m)
    w_q, w_s = quantize_rows_ref(torch.randn(n, k, generator=gen) * k**-0.5)
    x = torch.randn(m, k, generator=gen).half()
    b = torch.randn(n, generator=gen).half()
    y = sg.skinny_gemm(x.to(DEVICE), w_q.to(DEVICE), b.to(DEVICE), config=sg.GemmConfig(*cfg, swap_ab=True),
                       scale=w_s.reshape(-1).to(DEVICE))
    ref = (x.float() @ w_q.float().t()) * w_s.reshape(1, -1) + b.float()
    assert y.shape == (m, n)
    torch.testing.assert_close(y.float().cpu(), ref, atol=4e-3, rtol=2e-3)


def test_weight_only_rows_by_rows_and_shape() -> None:
    from pagedllm.kernels import skinny_gemm as sg
    from pagedllm.layers.quantization.fp8 import NARROW_MAX_ROWS, WEIGHT_ONLY_MAX_ROWS, weight_only_rows

    assert NARROW_MAX_ROWS <= sg.MAX_ROWS  # every product that keeps the 16-bit rows has a skinny tile
    assert weight_only_rows(1) and weight_only_rows(WEIGHT_ONLY_MAX_ROWS) and not weight_only_rows(WEIGHT_ONLY_MAX_ROWS + 1)
    # Past WEIGHT_ONLY_MAX_ROWS only products with no more outputs than inputs keep the 16-bit rows.
    narrow, wide = (4096, 14336), (28672, 4096)
    assert weight_only_rows(NARROW_MAX_ROWS, narrow) and weight_only_rows(NARROW_MAX_ROWS, (4096, 4096))
    assert not weight_only_rows(NARROW_MAX_ROWS, wide) and not weight_only_rows(NARROW_MAX_ROWS + 1, narrow)


def test_float8_tiles_by_rows_and_depth() -> None:
    """16 x 32 tiles up to 16 rows and over shallow inputs; swapped 64-row weight tiles over inputs of
    >= 4096 at 17-64 rows, split while the partials fit the workspace."""
    from pagedllm.kernels import skinny_gemm as sg

    assert sg.default_config(8, 4096, 14336) == sg.GemmConfig(16, 32, 256, 4, 3, 2)
    assert sg.default_config(32, 1024, 3072) == sg.GemmConfig(16, 32, 256, 4, 3, 4)
    assert sg.default_config(24, 4096, 4096) == sg.GemmConfig(32, 64, 128, 4, 3, 4, swap_ab=True)
    assert sg.default_config(64, 28672, 4096) == sg.GemmConfig(64, 64, 128, 4, 3, 2, swap_ab=True)
    assert sg.default_config(65, 4096, 4096) is None  # past MAX_ROWS: the tokens are quantized for cuBLAS
    for m, n, k in [(17, 6144, 4096), (33, 4096, 14336), (64, 128256, 4096)]:
        cfg = sg.default_config(m, n, k)
        assert cfg.swap_ab and sg.workspace_fits(cfg, m, n) and k % (cfg.block_k * cfg.split_k) == 0
