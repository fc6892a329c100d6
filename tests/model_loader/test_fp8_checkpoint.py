"""Float8 checkpoints load as stored (compressed-tensors per channel or per tensor, vLLM's ``fp8``), and other
quantized checkpoints are refused by name."""
from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file
from tiny_models import compressed_tensors_fp8_config, make_fp8_checkpoint, make_tiny_model

from pagedllm import LLM, SamplingParams
from pagedllm.layers.quantization.fp8 import FP8_DTYPE, Fp8LinearMethod
from pagedllm.model_loader.quant_config import checkpoint_quant_config

@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return make_tiny_model("llama", str(tmp_path_factory.mktemp("fp8ckpt") / "llama"))


def _llm(path: str, **kw) -> LLM:
    return LLM(model=path, dtype="float32", device="cpu", kv_cache_memory_bytes=1 << 22, max_model_len=128,
               skip_tokenizer_init=True, **kw)


_PROMPTS = [{"prompt_token_ids": list(range(5 + i, 30 + 9 * i))} for i in range(3)]
_PARAMS = SamplingParams(temperature=0.0, max_tokens=6, logprobs=5, ignore_eos=True)


def _logprobs(llm: LLM) -> list:
    return [[{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs]
            for o in llm.generate(_PROMPTS, _PARAMS, use_tqdm=False)]


def _fp8_linears(llm: LLM) -> list:
    model = llm.llm_engine.engine_core.executor.worker.model_runner.model
    return [m for m in model.modules() if isinstance(getattr(m, "quant_method", None), Fp8LinearMethod)]


def test_per_channel_checkpoint_equals_quantizing_at_load(tiny: str, tmp_path) -> None:
    path = make_fp8_checkpoint(tiny, str(tmp_path / "ct"), compressed_tensors_fp8_config("channel"), per_channel=True)
    stored = _llm(path)
    assert stored.llm_engine.config.model_config.quantization == "fp8"
    linears = _fp8_linears(stored)
    assert len(linears) == 8 and all(m.weight.dtype == FP8_DTYPE for m in linears)
    # Quantizing the 32-bit checkpoint at load makes the same float8 rows and scales, so the same numbers.
    assert _logprobs(stored) == _logprobs(_llm(tiny, quantization="fp8"))


@pytest.mark.parametrize("layout", ["compressed-tensors", "fp8"])
def test_per_tensor_checkpoint_broadcasts_each_shards_scale(tiny: str, tmp_path, layout: str) -> None:
    cfg = compressed_tensors_fp8_config("tensor") if layout == "compressed-tensors" else \
        {"quant_method": "fp8", "activation_scheme": "static"}
    path = make_fp8_checkpoint(tiny, str(tmp_path / layout), cfg, per_channel=False, input_scales=layout == "fp8")
    stored = _llm(path)
    qkv = _fp8_linears(stored)[0]
    ckpt = load_file(os.path.join(path, "model.safetensors"))
    q_rows = qkv.q_size
    assert torch.equal(qkv.weight_scale[:q_rows], ckpt["model.layers.0.self_attn.q_proj.weight_scale"].expand(q_rows))
    k_scale = ckpt["model.layers.0.self_attn.k_proj.weight_scale"]
    assert torch.equal(qkv.weight_scale[q_rows : q_rows + qkv.kv_size], k_scale.expand(qkv.kv_size))
    # One scale a tensor is coarser than one a row, but still the model: most top-5 tokens agree.
    full = _logprobs(_llm(tiny))
    for a, b in zip(full, _logprobs(stored)):
        assert len(set(a[0]) & set(b[0])) >= 3


def test_ignored_layers_stay_in_the_model_dtype(tiny: str, tmp_path) -> None:
    cfg = dict(compressed_tensors_fp8_config("channel"), ignore=["lm_head", "re:.*self_attn\\.k_proj", "re:.*down_proj"])
    path = make_fp8_checkpoint(tiny, str(tmp_path / "ign"), cfg, per_channel=True, keep=("q_proj", "k_proj",
                                                                                           "v_proj", "down_proj"))
    llm = _llm(path)
    model = llm.llm_engine.engine_core.executor.worker.model_runner.model
    for layer in model.model.layers:
        # k_proj is ignored, so the fused qkv layer is too (its checkpoint keeps q, k and v unquantized).
        assert layer.self_attn.qkv_proj.weight.dtype == torch.float32
        assert layer.mlp.down_proj.weight.dtype == torch.float32 and not layer.mlp.act_fn.quantize_output
        assert layer.self_attn.o_proj.weight.dtype == FP8_DTYPE and layer.mlp.gate_up_proj.weight.dtype == FP8_DTYPE
    full = _logprobs(_llm(tiny))
    for a, b in zip(full, _logprobs(llm)):
        assert len(set(a[0]) & set(b[0])) >= 3


@pytest.mark.parametrize(("cfg", "error", "message"), [
    ({"quant_method": "bitsandbytes", "bits": 4}, NotImplementedError, "checkpoint quantization 'bitsandbytes'.*awq"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, ValueError, "weight_block_size \\[128\\]"),
    ({"quant_method": "compressed-tensors", "format": "marlin-24", "config_groups": {}}, ValueError, "format 'marlin-24'"),
])
def test_other_quantized_checkpoints_are_refused_by_name(cfg: dict, error: type, message: str) -> None:
    class Config:
        quantization_config = cfg

    with pytest.raises(error, match=message):
        checkpoint_quant_config(Config())


def test_config_reads_ignore_lists() -> None:
    class Config:
        quantization_config = dict(compressed_tensors_fp8_config("channel"), ignore=["lm_head", "re:.*mlp\\.down_proj"])

    config = checkpoint_quant_config(Config())
    assert config.engine_method == "fp8" and not config.notes
    assert config.ignores("lm_head") and config.ignores("model.layers.3.mlp.down_proj")
    assert not config.ignores("model.layers.3.mlp.gate_up_proj")
