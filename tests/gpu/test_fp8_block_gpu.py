"""Block-wise float8 linears on the GPU (``kernels/fp8_block.py``): the activation groups' float8 rounding bit for
bit against the torch path (subnormals and carries into the next power of two included), the float8 tensor-core
product against the torch path's float32 one at decode and prefill sizes, and a block-float8 MoE checkpoint in
bfloat16 (its experts stacked for the grouped kernel, its steps in CUDA graphs) following its dequantized model."""
from __future__ import annotations

import os
import sys

import pytest
import torch

from pagedllm.kernels.fp8_block import fp8_block_linear, quantize_groups
from pagedllm.layers.quantization.fp8_block import FP8_DTYPE, Fp8BlockLinearMethod, fp8_group_quant_dequant

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICE = torch.device("cuda")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_activation_groups_round_as_the_torch_path(dtype):
    g = torch.Generator(device=DEVICE).manual_seed(0)
    k = 4096
    # Magnitudes spread over 2**-20..2**4 within each group: many values fall below float8's normal range.
    x = (torch.randn(64, k, generator=g, device=DEVICE) * torch.logspace(-6, 1, k, device=DEVICE)).to(dtype)
    x[3, 128:256] = 0.0
    q, s = quantize_groups(x, 128)
    deq = q.float() * s.repeat_interleave(128, dim=1)
    assert torch.equal(deq, fp8_group_quant_dequant(x, 128))


class _Layer(torch.nn.Module):
    def __init__(self, n: int, k: int, g: torch.Generator) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter((torch.randn(n, k, generator=g, device=DEVICE) * 100).clamp(-448, 448)
                                         .to(FP8_DTYPE), requires_grad=False)
        self.weight_scale_inv = torch.nn.Parameter(torch.rand(n // 128, k // 128, generator=g, device=DEVICE) * 1e-4
                                                   + 1e-5, requires_grad=False)


@pytest.mark.parametrize("m", [1, 16, 99, 1024])  # 99 and 1024: cuBLAS's block-scaled GEMM (99 padded to 100 rows)
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336)])
def test_block_product_matches_the_torch_path(m, n, k):
    g = torch.Generator(device=DEVICE).manual_seed(m + n)
    layer = _Layer(n, k, g)
    method = Fp8BlockLinearMethod((128, 128), "weight_scale_inv", 128)
    x = torch.randn(m, k, generator=g, device=DEVICE).bfloat16()
    got = method.apply(layer, x, None)
    want = method.torch_apply(layer, x, None)
    # bf16 outputs, float8 dots summed a block at a time: within a couple of bf16 roundings of the largest output.
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2 * want.abs().max().item(), rtol=2e-2)
    assert torch.equal(got, fp8_block_linear(x, layer.weight, layer.weight_scale_inv, (128, 128), 128))


def test_prefill_products_take_cublas_where_it_scales_blocks():
    """From CUDA 12.9 on Hopper, cuBLAS multiplies 1x128-by-128x128 block-scaled float8; the probe must find it
    there (else prefill silently keeps the slower kernel), and its column-major activation scales are the same."""
    from pagedllm.kernels import fp8_block

    g = torch.Generator(device=DEVICE).manual_seed(9)
    layer = _Layer(256, 1024, g)
    x = torch.randn(fp8_block.CUBLAS_MIN_ROWS, 1024, generator=g, device=DEVICE).bfloat16()
    taken = fp8_block._cublas_takes(x, layer.weight, (128, 128), 128)
    cuda = tuple(int(v) for v in torch.version.cuda.split("."))
    if torch.cuda.get_device_capability() == (9, 0) and cuda >= (12, 9):
        assert taken
    q, s = quantize_groups(x, 128)
    q_t, s_t = quantize_groups(x, 128, rows_minor=True)
    assert s_t.stride() == (1, x.shape[0]) and torch.equal(s_t, s) and torch.equal(q_t.float(), q.float())


def test_block_float8_moe_checkpoint_follows_its_dequantized_model(tmp_path):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "models"))
    from test_quantized_moe import _quantized_pair, assert_follows

    from pagedllm import LLM, SamplingParams

    ckpt, ref = _quantized_pair("qwen3_moe", "fp8-block", tmp_path)
    prompts = [list(range(3, 20)), list(range(40, 71))]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)

    def run(path: str):
        llm = LLM(model=path, dtype="bfloat16", device="cuda", skip_tokenizer_init=True, max_model_len=128,
                  gpu_memory_utilization=0.1)
        try:
            runner = llm.llm_engine.engine_core.executor.worker.model_runner
            if path == ckpt:  # its experts stacked for the grouped kernel, its steps in CUDA graphs
                from pagedllm.layers.fused_moe import MoEExperts

                moe = [m for m in runner.model.modules() if isinstance(m, MoEExperts)]
                assert moe and all(m.w13_packed is not None for m in moe) and runner.use_cuda_graphs
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        finally:
            llm.llm_engine.shutdown()
        return [list(o.outputs[0].token_ids) for o in outs], [o.outputs[0].logprobs for o in outs]

    tokens, lps = run(ckpt)
    ref_tokens, ref_lps = run(ref)
    assert_follows(tokens, lps, ref_tokens, ref_lps, tie=1e-1, tol=1e-1)
