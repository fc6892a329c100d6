"""Quantized checkpoints (AWQ, GPTQ, compressed-tensors W4A16 / W8A16 / W8A8, block-wise float8) and ``--quantization
int8`` end to end: greedy tokens over a few prompts equal the reference's in float32 (``quant_checkpoints.py``
says what each reference is)."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

pytest.importorskip("compressed_tensors")

import quant_checkpoints as qc  # noqa: E402

from pagedllm import LLM, SamplingParams  # noqa: E402

PROMPTS = [list(range(5 + 3 * i, 21 + 11 * i)) for i in range(4)]
MAX_TOKENS = 8


def _llm(path: str, **kw) -> LLM:
    return LLM(model=path, dtype="float32", device="cpu", kv_cache_memory_bytes=1 << 23, max_model_len=128,
               skip_tokenizer_init=True, **kw)


def pagedllm_greedy(path: str, **kw) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = _llm(path, **kw).generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@torch.no_grad()
def hf_greedy(model) -> list[list[int]]:
    tokens = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        for _ in range(MAX_TOKENS):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        tokens.append(ids[0, len(prompt):].tolist())
    return tokens


def _hf_dir(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("name", list(qc.CT_SCHEMES))
def test_compressed_tensors_checkpoint_matches_the_library(name: str) -> None:
    path = qc.make_ct(name)
    assert pagedllm_greedy(path) == hf_greedy(qc.ct_reference_model(path))


def test_ignored_linears_load_as_float_weights() -> None:
    llm = _llm(qc.make_ct("ct-w4a16-g128-ignore-down"))
    model = llm.llm_engine.engine_core.executor.worker.model_runner.model
    for layer in model.model.layers:
        assert layer.mlp.down_proj.weight.dtype == torch.float32
        gate_up = layer.mlp.gate_up_proj
        packed = gate_up.wna16.qrows if hasattr(gate_up, "wna16") else gate_up.weight_packed  # the CPU kernel's rows
        assert packed.dtype == torch.int32 and not hasattr(gate_up, "weight")


@pytest.mark.parametrize(("bits", "group", "desc_act", "sym", "fmt"), [
    (4, 128, False, True, "gptq"),
    (4, 32, True, False, "gptq"),
    (4, 64, True, True, "gptq_v2"),
    (8, 128, True, False, "gptq"),
    (8, -1, False, True, "gptq"),
    (4, -1, True, False, "gptq"),
])
def test_gptq_checkpoint_matches_its_dequantized_weights(bits, group, desc_act, sym, fmt) -> None:
    path, ref = qc.make_gptq(bits, group, desc_act, sym, fmt)
    assert pagedllm_greedy(path) == hf_greedy(_hf_dir(ref))


def test_gptq_dynamic_exclusions_load_as_float_weights() -> None:
    """GPTQModel's ``dynamic`` "-:" rules name modules stored unquantized (here every attention projection): they
    load as float weights, and the model follows its reference."""
    path, ref = qc.make_gptq(4, 128, False, True, skip=r".*self_attn\.")
    llm = _llm(path)
    for layer in llm.llm_engine.engine_core.executor.worker.model_runner.model.model.layers:
        assert layer.self_attn.qkv_proj.weight.dtype == torch.float32 and layer.self_attn.o_proj.keep_unquantized
        assert not getattr(layer.mlp.down_proj, "keep_unquantized", False)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == hf_greedy(_hf_dir(ref))


@pytest.mark.parametrize("group", [64, 128])
def test_awq_checkpoint_matches_its_dequantized_weights(group: int) -> None:
    path, ref = qc.make_awq(group)
    assert pagedllm_greedy(path) == hf_greedy(_hf_dir(ref))


def test_fp8_block_checkpoint_in_vllm_layout_equals_compressed_tensors(tmp_path) -> None:
    """vLLM's ``fp8`` layout with ``weight_block_size`` holds the same numbers under other names."""
    from safetensors.torch import load_file, save_file

    src = qc.make_ct("ct-fp8-block")
    dst = tmp_path / "fp8-block"
    shutil.copytree(src, dst)
    tensors = {(k[: -len("weight_scale")] + "weight_scale_inv" if k.endswith(".weight_scale") else k): v
               for k, v in load_file(os.path.join(src, "model.safetensors")).items()}
    save_file(tensors, str(dst / "model.safetensors"))
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128], "ignored_layers": ["lm_head"]}
    (dst / "config.json").write_text(json.dumps(config))
    llm = _llm(str(dst))
    assert llm.llm_engine.config.model_config.quantization == "fp8"
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == pagedllm_greedy(src)


@pytest.mark.parametrize("file", ["quantize_config.json", "quant_config.json"])
def test_quantization_stated_only_in_the_quantizers_own_file(tmp_path, file: str) -> None:
    """Older checkpoints whose config.json states no quantization: AutoGPTQ's ``quantize_config.json`` (no
    quant_method) and AutoAWQ's ``quant_config.json`` (its own key names) load as the config.json entry does."""
    src = qc.make_gptq(4, 128, True, False)[0] if file == "quantize_config.json" else qc.make_awq(128)[0]
    dst = tmp_path / "side"
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    quant = config.pop("quantization_config")
    del quant["quant_method"]
    if file == "quant_config.json":
        quant = {"zero_point": True, "q_group_size": quant["group_size"], "w_bit": quant["bits"], "version": "GEMM"}
    (dst / "config.json").write_text(json.dumps(config))
    (dst / file).write_text(json.dumps(quant))
    llm = _llm(str(dst))
    assert llm.llm_engine.config.model_config.quantization == ("gptq" if file == "quantize_config.json" else "awq")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == pagedllm_greedy(src)
    (dst / file).write_text(json.dumps({**quant, "w_bit": 3} if "w_bit" in quant else {**quant, "bits": 3}))
    with pytest.raises(ValueError, match=f"{file}: quantization_config \\((gptq|awq)\\): bits 3 is not supported"):
        _llm(str(dst))


@pytest.mark.parametrize(("legacy", "per_channel"), [(False, False), (True, False), (False, True)])
def test_modelopt_fp8_checkpoint_matches_its_float8_products(legacy: bool, per_channel: bool) -> None:
    """NVIDIA Model Optimizer's FP8 export (made by nvidia-modelopt), with its config in config.json or, as older
    exports, only in hf_quant_config.json: float8 weights with a scale per tensor, its excluded lm_head unquantized,
    its KV-cache scales on the attention layers; or with a scale per weight row (FP8_PER_CHANNEL_PER_TOKEN). pagedllm
    quantizes the linears' inputs per token (the static input scales go unused), so the reference is
    transformers' model with each decoder linear replaced by that product over the checkpoint's float8 weight."""
    pytest.importorskip("modelopt")
    from safetensors.torch import load_file

    from pagedllm.layers.quantization.fp8 import fp8_linear_ref

    ckpt, ref = qc.make_modelopt_fp8(legacy, per_channel)
    stored = load_file(os.path.join(ckpt, "model.safetensors"))
    ref_model = _hf_dir(ref)
    for name, module in ref_model.named_modules():
        if name + ".weight_scale" in stored:
            weight, scale = stored[name + ".weight"], stored[name + ".weight_scale"].float().reshape(-1).expand(
                module.out_features)
            module.forward = lambda x, w=weight, s=scale: fp8_linear_ref(x.reshape(-1, x.shape[-1]), w, s, None).reshape(
                *x.shape[:-1], -1)
    llm = _llm(ckpt, quantization="modelopt")
    model = llm.llm_engine.engine_core.executor.worker.model_runner.model
    assert model.model.layers[0].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
    assert model.lm_head.weight.dtype == torch.float32
    if not per_channel:
        k_scale = float(stored["model.layers.0.self_attn.k_proj.k_scale"])
        assert model.model.layers[0].self_attn.attn.checkpoint_kv_scales[0] == pytest.approx(k_scale)  # float8 cache
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == hf_greedy(ref_model)


def test_modelopt_fp8_moe_checkpoint_follows_its_dequantized_model() -> None:
    """A Qwen3-MoE exported by Model Optimizer in FP8: each expert's float8 projections load (its routers, excluded,
    stay float). Tolerance: the float8 activations the experts' products take make the log-probabilities differ from
    the dequantized float32 model's by rounding, so the next token's top 5 must share 4 and its log-probability agree
    within 0.05."""
    pytest.importorskip("modelopt")
    ckpt, ref = qc.make_modelopt_fp8(moe=True)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=5)

    def top5(path: str) -> list[dict[int, float]]:
        outs = _llm(path).generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        return [{t: lp.logprob for t, lp in o.outputs[0].logprobs[0].items()} for o in outs]

    for got, want in zip(top5(ckpt), top5(ref)):
        assert len(got.keys() & want.keys()) >= 4
        best = max(want, key=want.get)
        assert best in got and abs(got[best] - want[best]) < 0.05


def test_online_int8_equals_the_compressed_tensors_w8a8_checkpoint() -> None:
    """``--quantization int8`` rounds each weight row as compressed-tensors does, so a float model quantized at load
    and the W8A8 checkpoint compressed-tensors makes of it give the same logprobs."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3)

    def run(path: str, **kw):
        outs = _llm(path, **kw).generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        return [[{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs] for o in outs]

    online = run(qc.base_model(), quantization="int8")
    stored = run(qc.make_ct("ct-w8a8"))
    for a, b in zip(online, stored):
        for da, db in zip(a, b):
            assert da.keys() == db.keys()
            assert all(abs(da[t] - db[t]) < 1e-4 for t in da)


def test_quantization_flag_must_match_the_checkpoint() -> None:
    from pagedllm.engine_args import EngineArgs

    gptq, _ = qc.make_gptq(4, 128, False, True)
    with pytest.raises(ValueError, match="quantization 'int8' conflicts with the checkpoint's quantization_config "
                                         "\\(quant_method 'gptq'\\)"):
        EngineArgs(model=gptq, device="cpu", quantization="int8").create_engine_config()
    assert EngineArgs(model=gptq, device="cpu", quantization="gptq").create_engine_config().model_config.quantization == "gptq"
    with pytest.raises(ValueError, match="quantization 'awq' reads checkpoints stored that way.*no quantization_config"):
        EngineArgs(model=qc.base_model(), device="cpu", quantization="awq").create_engine_config()


def test_vllm_kernel_names_read_their_checkpoints() -> None:
    """vLLM's ``--quantization awq_marlin`` / ``gptq_marlin`` / ``moe_wna16`` name its kernels over AWQ/GPTQ
    checkpoints: they load those checkpoints as awq/gptq and refuse any other, naming both."""
    from pagedllm.engine_args import EngineArgs

    gptq, _ = qc.make_gptq(4, 128, False, True)
    awq, _ = qc.make_awq(128)
    for flag, path, method in (("gptq_marlin", gptq, "gptq"), ("moe_wna16", gptq, "gptq"), ("awq_marlin", awq, "awq"),
                               ("moe_wna16", awq, "awq")):
        config = EngineArgs(model=path, device="cpu", quantization=flag).create_engine_config()
        assert config.model_config.quantization == method
    with pytest.raises(ValueError, match="quantization 'awq_marlin' reads checkpoints whose quantization_config has "
                                         "quant_method 'awq'; .* has 'gptq'"):
        EngineArgs(model=gptq, device="cpu", quantization="awq_marlin").create_engine_config()
    with pytest.raises(ValueError, match="quantization 'gptq_marlin' .* has none"):
        EngineArgs(model=qc.base_model(), device="cpu", quantization="gptq_marlin").create_engine_config()
    with pytest.raises(ValueError, match="quantization must be one of .*awq_marlin.* got 'marlin'"):
        EngineArgs(model=gptq, device="cpu", quantization="marlin").create_engine_config()


@pytest.mark.parametrize("name", ["ct-w4a16-g128-sym", "ct-w4a16-channel", "ct-w8a8", "ct-fp8-block"])
def test_compressed_tensors_checkpoint_matches_transformers(name: str) -> None:
    """transformers loading the checkpoint itself (through compressed-tensors) gives the same tokens. Asymmetric
    packed zero points are left out: this transformers release sizes them unpacked and refuses the checkpoint."""
    path = qc.make_ct(name)
    assert pagedllm_greedy(path) == hf_greedy(_hf_dir(path))
