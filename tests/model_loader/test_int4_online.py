"""``--quantization int4``: a float checkpoint quantized at load to 4-bit weights (Q4_0 blocks read by the packed CPU
kernel; groups of 128 in the W4A16 layout on CUDA) gives the logits and greedy tokens of the same model with each
linear's weight replaced by its 4-bit values dequantized, which the ``gguf`` package's own decoder makes."""
from __future__ import annotations

import pytest
import torch

gguf = pytest.importorskip("gguf")
pytest.importorskip("compressed_tensors")

import quant_checkpoints as qc  # noqa: E402
from gguf import GGMLQuantizationType as T  # noqa: E402

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.kernels.cpu import gguf_gemm  # noqa: E402
from pagedllm.layers.linear import RowParallelLinear  # noqa: E402
from pagedllm.layers.quantization import int4  # noqa: E402

PROMPTS = [list(range(5 + 3 * i, 21 + 11 * i)) for i in range(4)]
MAX_TOKENS = 8
# The kernel sums in a different order than a float32 matmul of the decoded weight.
REL = 1e-3


def _q4_0_reference() -> str:
    """The base model with every decoder linear's weight replaced by its Q4_0 values decoded by ``gguf``."""

    def make(dst: str) -> None:
        state = qc._base_state()
        for module, _ in qc._linear_items(state):
            w = state[module + ".weight"]
            rows = gguf.quants.quantize(w.float().numpy(), T.Q4_0)
            state[module + ".weight"] = torch.from_numpy(gguf.quants.dequantize(rows, T.Q4_0)).to(w.dtype)
        qc._write(dst, state, None)

    return qc._cached("int4-q4_0-reference", make)


def _run(path: str, **kw) -> tuple[list[list[int]], list[list[dict[int, float]]], LLM]:
    llm = LLM(model=path, dtype="float32", device="cpu", kv_cache_memory_bytes=1 << 23, max_model_len=128,
              skip_tokenizer_init=True, **kw)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [[{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs] for o in outs]
    return tokens, logprobs, llm


@pytest.mark.skipif(not gguf_gemm.available(), reason="the packed GGUF CPU kernel is not available")
def test_online_int4_equals_the_decoded_q4_0_model() -> None:
    tokens, logprobs, llm = _run(qc.base_model(), quantization="int4")
    ref_tokens, ref_logprobs, _ = _run(_q4_0_reference())
    assert tokens == ref_tokens
    for a, b in zip(logprobs, ref_logprobs):
        for da, db in zip(a, b):
            assert da.keys() == db.keys()
            assert all(abs(da[t] - db[t]) < 1e-3 for t in da)
    model = llm.llm_engine.engine_core.executor.worker.model_runner.model
    for layer in (model.model.layers[0].mlp.down_proj, model.model.layers[1].self_attn.qkv_proj):
        # uint8 Q4_0 rows and no float weight left
        assert isinstance(layer.quant_method, int4.Int4LinearMethod)
        assert layer.qweight_0.dtype == torch.uint8 and not hasattr(layer, "weight")


def test_int4_layer_product_and_fallback() -> None:
    """The CPU layer's product against the decoded weight's float product; a layer whose inputs are not whole
    blocks of 32 is left unquantized by ``quantize_model``."""
    torch.manual_seed(0)
    layer = RowParallelLinear(256, 96, bias=True, params_dtype=torch.float32)
    layer.weight.data.normal_(0, 0.05)
    layer.bias.data.normal_()
    x = torch.randn(5, 256)
    layer.quant_method = int4.Int4LinearMethod()
    int4.Int4LinearMethod.quantize_loaded(layer)
    decoded = layer.quant_method.dequantize(layer)
    want = torch.nn.functional.linear(x, decoded, layer.bias)
    got = layer(x)
    got = got[0] if isinstance(got, tuple) else got
    assert ((got - want).abs().max() / want.abs().max()).item() <= REL

    from pagedllm.layers.quantization import quantize_model

    model = torch.nn.Sequential(RowParallelLinear(40, 8, bias=False, params_dtype=torch.float32))
    assert quantize_model(model, "int4") == 0
    assert model[0].weight.dtype == torch.float32


def test_cuda_layout_rounds_each_group_of_128_symmetrically() -> None:
    """The W4A16 layout made for CUDA (built here on the CPU): each value is within half a step of its weight, and
    the largest magnitude of each group sits on the grid's end (+-7.5 steps around the zero point 8 -> 0 or 15)."""
    torch.manual_seed(1)
    w = torch.randn(64, 256)
    packed = int4.wna16_symmetric(w)
    assert packed.qweight.shape == (256 // 8, 64) and packed.scales.shape == (2, 64) and packed.group_size == 128
    decoded = packed.dequantize()  # [N, K]
    step = packed.scales.float().repeat_interleave(128, dim=0).t()  # [N, K]
    assert bool(((decoded - w).abs() <= step * 0.5 + 1e-6).all())
