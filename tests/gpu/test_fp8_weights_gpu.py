"""Float8 weights on the GPU: the Triton row quantizer bit-exact against torch on hardware rounding, both
fast products against the float32 reference, and a quantized model's graph and eager runs identical."""
from __future__ import annotations

import gc

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.kernels import fp8_quant, gemv, skinny_gemm
from pagedllm.layers.quantization.fp8 import Fp8LinearMethod, fp8_linear_ref, quantize_rows_ref, weight_only_rows
from tiny_models import make_tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("m", "k"), [(1, 4096), (37, 1024), (256, 14336)])
def test_row_quantizer_is_bit_exact(m: int, k: int, dtype: torch.dtype) -> None:
    x = (torch.randn(m, k, device="cuda") * torch.logspace(-3, 2, m, device="cuda")[:, None]).to(dtype)
    q, s = fp8_quant.quantize_rows(x)
    ref_q, ref_s = quantize_rows_ref(x)
    assert torch.equal(s, ref_s)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))


class _Layer(torch.nn.Module):
    def __init__(self, n: int, k: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter((torch.randn(n, k, device="cuda") * k**-0.5).to(dtype), requires_grad=False)
        Fp8LinearMethod.process_weights_after_loading(self)


@pytest.mark.parametrize(("m", "n", "k"), [(1, 6144, 4096), (1, 4096, 14336), (7, 6144, 4096), (24, 6144, 4096),
                                           (64, 4096, 14336), (64, 28672, 4096), (256, 4096, 14336),
                                           (1000, 28672, 4096)])
def test_fp8_products_match_the_reference(m: int, n: int, k: int) -> None:
    layer = _Layer(n, k, torch.bfloat16)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    y = Fp8LinearMethod().apply(layer, x, bias)
    if weight_only_rows(m, (n, k)):
        # The GEMV (one row) and the skinny GEMM (2-32 rows, or up to 64 with n <= k) keep the activation
        # in 16 bits: the reference is the 16-bit rows times the float8 weight.
        assert gemv.usable(x, layer.weight) or skinny_gemm.usable(x, layer.weight)
        ref = (x.float() @ layer.weight.float().t()) * layer.weight_scale[None, :] + bias.float()
    else:
        ref = fp8_linear_ref(x.float(), layer.weight, layer.weight_scale, bias.float())
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    # float32 sums in another order, then one bf16 rounding of the output (|y| ~ 1-4).
    torch.testing.assert_close(y.float(), ref, atol=3e-2, rtol=1e-2)


def test_quantized_model_graph_and_eager_identical(tmp_path) -> None:
    path = make_tiny_model("qwen3", tmp_path / "qwen3")
    gen = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(3, 380, (int(n),), generator=gen).tolist()} for n in (5, 19, 33, 2)]
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=m, detokenize=False) for m in (9, 17, 4, 23)]
    outs = []
    for eager in (False, True):
        llm = LLM(model=path, skip_tokenizer_init=True, max_num_seqs=8, max_model_len=256, seed=0, dtype="bfloat16",
                  quantization="fp8", enforce_eager=eager)
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert outs[0] == outs[1]
    assert [len(t) for t in outs[0]] == [9, 17, 4, 23]


@pytest.mark.parametrize(("kind", "quantization"), [("llama", "fp8"), ("gemma3", "fp8"), ("llama", "int8"),
                                                    ("gemma3", "int8"), ("llama", "int8_zp")])
def test_fused_input_quantization_changes_no_bit(tmp_path, kind: str, quantization: str) -> None:
    """Norms and activations that quantize their own output (float8, or W8A8's int8: quantized at load, or a
    checkpoint whose activations take a zero point per token) give the logprobs of the standalone quantizer; the
    100-token prompt takes the int8 tiles, the others the decode kernel and cuBLAS."""
    if quantization == "int8_zp":
        pytest.importorskip("compressed_tensors")
        import quant_checkpoints as qc

        path, online = qc.make_ct("ct-w8a8-asym-act"), None
    else:
        path, online = make_tiny_model(kind, tmp_path / kind), quantization
    gen = torch.Generator().manual_seed(1)
    prompts = [{"prompt_token_ids": torch.randint(3, 380, (int(n),), generator=gen).tolist()}
               for n in (7, 30, 12, 100)]
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=12, logprobs=5, detokenize=False)
    llm = LLM(model=path, skip_tokenizer_init=True, max_num_seqs=8, max_model_len=256, seed=0, dtype="bfloat16",
              quantization=online, enforce_eager=True)
    model = llm.llm_engine.engine_core.executor.worker.model_runner.model
    producers = [m for m in model.modules() if getattr(m, "quantize_output", None) == quantization]
    # input norm -> qkv, the norm before the MLP -> gate_up, the activation -> down: three a layer
    assert len(producers) == 3 * llm.llm_engine.config.model_config.hf_config.num_hidden_layers
    fused = llm.generate(prompts, params, use_tqdm=False)
    for m in producers:
        m.quantize_output = None
    plain = llm.generate(prompts, params, use_tqdm=False)
    llm.llm_engine.engine_core.shutdown()
    for a, b in zip(fused, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [{t: lp.logprob for t, lp in d.items()} for d in a.outputs[0].logprobs] == \
               [{t: lp.logprob for t, lp in d.items()} for d in b.outputs[0].logprobs]


@pytest.mark.parametrize("m", [2, 7, 16])
def test_skinny_float8_product_keeps_the_16_bit_activation(m: int) -> None:
    layer = _Layer(6144, 4096, torch.bfloat16)
    x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
    y = Fp8LinearMethod().apply(layer, x, None)
    ref = (x.float() @ layer.weight.float().t()) * layer.weight_scale[None, :]
    torch.testing.assert_close(y.float(), ref, atol=3e-2, rtol=1e-2)


def test_float8_checkpoint_on_the_gpu_equals_quantizing_at_load(tmp_path) -> None:
    """A per-channel compressed-tensors checkpoint, loaded on the GPU in bf16, runs the same numbers as its
    32-bit source quantized at load (same float8 rows and scales, same products)."""
    import shutil

    from safetensors.torch import load_file, save_file
    from tiny_models import compressed_tensors_fp8_config, make_fp8_checkpoint

    # A bf16 source, so that quantizing at load starts from the very values the checkpoint was made of.
    fp32 = make_tiny_model("qwen3", tmp_path / "fp32")
    src = str(tmp_path / "src")
    shutil.copytree(fp32, src)
    weights = {k: v.to(torch.bfloat16) for k, v in load_file(f"{fp32}/model.safetensors").items()}
    save_file(weights, f"{src}/model.safetensors")
    ckpt = make_fp8_checkpoint(src, str(tmp_path / "fp8"), compressed_tensors_fp8_config("channel"), per_channel=True)
    gen = torch.Generator().manual_seed(2)
    prompts = [{"prompt_token_ids": torch.randint(3, 380, (int(n),), generator=gen).tolist()} for n in (9, 40, 3)]
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=10, logprobs=3, detokenize=False)
    outs = []
    for path, quantization in ((ckpt, None), (src, "fp8")):
        llm = LLM(model=path, skip_tokenizer_init=True, max_num_seqs=8, max_model_len=256, seed=0, dtype="bfloat16",
                  quantization=quantization)
        outs.append([[{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs]
                     for o in llm.generate(prompts, params, use_tqdm=False)])
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert outs[0] == outs[1]
