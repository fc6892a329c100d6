"""Mixture-of-experts GGUF files (qwen3moe, qwen2moe, and llama with experts for Mixtral), written from tiny random
HF models as llama.cpp's converter lays them out: the same pagedllm weights and greedy tokens as the HF safetensors of
the same float32 values, transformers' own GGUF reading where it has one, an expert-parallel rank's reads, experts
kept packed on the CPU (Q8_0, Q4_K_M's types) against the same experts dequantized, also split over tensor-, expert-
and data-parallel ranks, and malformed expert tensors refused by name."""
from __future__ import annotations

import json
import logging
import os
from collections import Counter

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from gguf import GGMLQuantizationType as T  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402
from test_gguf_loader import _config_diff, _llama_cpp_permute, _reference_checkpoint  # noqa: E402
from test_gguf_packed import _K_SCALES, _blocks, assert_relative, load, prefill_logits  # noqa: E402
from tiny_models import make_tiny_model  # noqa: E402
from transformers import AutoConfig  # noqa: E402

from pagedllm import LLM, SamplingParams, envs  # noqa: E402
from pagedllm.attention.registry import get_attn_backend  # noqa: E402
from pagedllm.config import LoadConfig, ModelConfig  # noqa: E402
from pagedllm.model_loader.gguf_cache import find_converted  # noqa: E402
from pagedllm.model_loader.gguf_loader import gguf_hf_config, gguf_to_hf_names, iter_gguf_weights  # noqa: E402
from pagedllm.model_loader.loader import get_model  # noqa: E402

# kind -> (GGUF architecture, HF architecture, config overrides of the tiny model). Every layer sparse, as
# llama.cpp's qwen2moe/qwen3moe require; widths multiples of 32 so Q8_0 blocks fit every row.
KINDS = {
    "qwen3_moe": ("qwen3moe", "Qwen3MoeForCausalLM",
                  dict(num_hidden_layers=2, num_experts=8, num_experts_per_tok=2, mlp_only_layers=[])),
    "qwen2_moe": ("qwen2moe", "Qwen2MoeForCausalLM",
                  dict(num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, shared_expert_intermediate_size=64)),
    "mixtral": ("llama", "MixtralForCausalLM", dict(num_local_experts=4)),
}
PROJ = {"mixtral": ("block_sparse_moe", ("w1", "w3", "w2")), "qwen2_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
        "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj"))}
STACKED = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
CPU = torch.device("cpu")


def _encoded(value: np.ndarray, qtype: T) -> tuple[np.ndarray, np.ndarray]:
    """(what the GGUF stores, the float32 values it decodes to) of ``value`` in ``qtype``; a k-quant, which gguf-py
    cannot quantize to, as random codes under small scales (``test_gguf_packed._blocks``)."""
    if qtype == T.F32:
        return value, value
    if qtype == T.F16:
        return value.astype(np.float16), value.astype(np.float16).astype(np.float32)
    if qtype in _K_SCALES:
        rows = value.reshape(-1, value.shape[-1])
        blocks = _blocks(rows, qtype, np.random.default_rng(rows.shape[0])).reshape(*value.shape[:-1], -1)
    else:
        blocks = gguf.quants.quantize(value, qtype)
    return blocks, gguf.quants.dequantize(blocks, qtype).reshape(value.shape).astype(np.float32)


def write_moe_gguf(hf_dir: str, path: str, kind: str, qtype: T = T.F32, edit=None,
                   expert_qtypes: tuple[T, T, T] | None = None) -> dict[str, np.ndarray]:
    """The HF checkpoint in ``hf_dir`` as llama.cpp's converter writes it: experts stacked per layer and projection,
    llama Q/K rows interleaved, routers and vectors in F32, the shared expert's gate squeezed to [H]; every other
    matrix in ``qtype``, the stacked experts in ``expert_qtypes`` (gate, up, down) when given. ``edit(gguf_name,
    array)`` may change a tensor or drop it (None). Returns the HF tensors (per expert) holding the float32 values
    the file decodes to."""
    arch, hf_arch, _ = KINDS[kind]
    with open(os.path.join(hf_dir, "config.json")) as f:
        c = json.load(f)
    hf = load_file(os.path.join(hf_dir, "model.safetensors"))
    layers, heads, kv_heads = c["num_hidden_layers"], c["num_attention_heads"], c["num_key_value_heads"]
    experts = c.get("num_experts") or c["num_local_experts"]
    head_dim = c.get("head_dim") or c["hidden_size"] // heads
    w = gguf.GGUFWriter(path, arch)
    w.add_context_length(256)
    w.add_embedding_length(c["hidden_size"])
    w.add_block_count(layers)
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    if kind == "qwen3_moe":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(c["rope_parameters"]["rope_theta"]))
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_expert_count(experts)
    w.add_expert_used_count(c["num_experts_per_tok"])
    if kind != "mixtral":  # llama.cpp's converter writes Mixtral's expert width as the feed-forward length
        w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    if kind == "qwen2_moe":
        w.add_expert_shared_feed_forward_length(c["shared_expert_intermediate_size"])
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(c["vocab_size"])])
    w.add_token_types([1] * c["vocab_size"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    block, projs = PROJ[kind]
    to_gguf = {v: k for k, v in gguf_to_hf_names(arch, layers, hf_arch).items()}
    tensors: dict[str, tuple[list[str], np.ndarray, np.ndarray]] = {}  # gguf name -> (HF names, HF value, stored)
    for name, value in hf.items():
        if ".experts." in name:
            continue
        stored = value
        if kind == "mixtral" and ".q_proj." in name:
            stored = _llama_cpp_permute(value, heads)
        elif kind == "mixtral" and ".k_proj." in name:
            stored = _llama_cpp_permute(value, kv_heads)
        elif name.endswith("shared_expert_gate.weight"):
            stored = value.reshape(-1)  # [1, H] -> [H], as converters that squeeze tensors write it
        tensors[to_gguf[name]] = ([name], value, stored)
    for i in range(layers):
        for stacked, proj in zip(STACKED, projs):
            names = [f"model.layers.{i}.{block}.experts.{e}.{proj}.weight" for e in range(experts)]
            value = np.stack([hf[n] for n in names])  # [E, N, K]
            tensors[f"blk.{i}.{stacked}.weight"] = (names, value, value)
    decoded: dict[str, np.ndarray] = {}
    for gguf_name, (names, value, stored) in tensors.items():
        if edit is not None and (stored := edit(gguf_name, stored)) is None:
            continue
        # llama.cpp keeps routers (and vectors) in F32. Quantization is per row, so the rows that the Q/K
        # interleave moves decode alike.
        t = qtype if stored.ndim >= 2 and ".ffn_gate_inp" not in gguf_name else T.F32
        if expert_qtypes is not None and stored.ndim == 3:
            t = expert_qtypes[STACKED.index(gguf_name.split(".")[2])]
        raw, back = _encoded(stored, t)
        if stored is not value:  # Q/K rows interleaved: the HF values decode from the rows un-permuted
            back = _encoded(value, t)[1]
        w.add_tensor(gguf_name, raw, raw_dtype=t if raw.dtype == np.uint8 else None)
        decoded |= dict(zip(names, back)) if len(names) > 1 else {names[0]: back}
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return decoded


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory) -> dict[str, str]:
    """The tiny HF checkpoints (config.json + per-expert safetensors), one per kind."""
    root = tmp_path_factory.mktemp("hf")
    return {kind: make_tiny_model(kind, root / kind, seed=1, **KINDS[kind][2]) for kind in KINDS}


def _reference_dir(hf_dir: str, out, decoded: dict[str, np.ndarray]) -> str:
    """The HF checkpoint with the float32 values the GGUF decodes to (the original's, unless rounded to a type)."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(hf_dir, "config.json")) as f, open(os.path.join(out, "config.json"), "w") as g:
        g.write(f.read())
    save_file({k: np.ascontiguousarray(v) for k, v in decoded.items()}, os.path.join(out, "model.safetensors"))
    return os.fspath(out)


def _load(model: str, config, fmt: str, quantization: str | None = None) -> torch.nn.Module:
    model_config = ModelConfig(model=model, tokenizer=None, hf_config=config, dtype=torch.float32, max_model_len=256,
                               gguf_file=model if fmt == "gguf" else None, quantization=quantization)
    return get_model(model_config, LoadConfig(load_format=fmt), CPU, get_attn_backend("torch_ref", "cpu"))


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_config_and_weights_are_the_hf_checkpoints(kind: str, hf_models, tmp_path) -> None:
    hf_arch = KINDS[kind][1]
    path = str(tmp_path / "m.gguf")
    decoded = write_moe_gguf(hf_models[kind], path, kind)
    config = gguf_hf_config(path)
    hf = AutoConfig.from_pretrained(hf_models[kind])
    assert config.architectures == [hf_arch] and config.model_type == kind

    def head_dim(c) -> int:
        return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads

    assert head_dim(config) == head_dim(hf)
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size",
                "num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "intermediate_size",
                "shared_expert_intermediate_size", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers",
                "tie_word_embeddings", "rope_parameters"):
        assert getattr(config, key, None) == getattr(hf, key, None), key
    assert config.rms_norm_eps == pytest.approx(hf.rms_norm_eps, rel=1e-7)  # stored as float32
    ours = dict(iter_gguf_weights(path))
    assert ours.keys() == decoded.keys() == load_file(os.path.join(hf_models[kind], "model.safetensors")).keys()
    for name, w in ours.items():  # float32 files: the HF values bit for bit (Q/K rows un-permuted)
        np.testing.assert_array_equal(w.numpy(), decoded[name], err_msg=name)


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.Q8_0], ids=lambda t: t.name)
def test_gguf_model_equals_safetensors_model(kind: str, qtype: T, hf_models, tmp_path) -> None:
    """load_format="gguf" (dense) builds the pagedllm model of the safetensors holding the values the file decodes to."""
    path = str(tmp_path / "m.gguf")
    ref = _reference_dir(hf_models[kind], tmp_path / "ref", write_moe_gguf(hf_models[kind], path, kind, qtype))
    config = gguf_hf_config(path)
    from_gguf, from_safetensors = _load(path, config, "gguf").state_dict(), _load(ref, config, "safetensors").state_dict()
    assert from_gguf.keys() == from_safetensors.keys()
    assert any("experts.w13_weight" in k for k in from_gguf)
    for name, value in from_gguf.items():
        assert torch.equal(value, from_safetensors[name]), name


PROMPTS = [[3, 17, 250, 8, 99, 4, 41], [7, 7, 120, 299, 5], list(range(10, 40))]


def _greedy(model: str, prompts: list[list[int]] = PROMPTS, **kwargs) -> list[list[int]]:
    llm = LLM(model=model, dtype="float32", device="cpu", skip_tokenizer_init=True, max_model_len=256,
              kv_cache_memory_bytes=1 << 22, **kwargs)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_engine_greedy_tokens_equal_safetensors(kind: str, hf_models, tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.setattr(envs, "PAGEDLLM_CACHE", tmp_path / "cache")  # no converted copy from another test
    path = str(tmp_path / "m.gguf")
    write_moe_gguf(hf_models[kind], path, kind)
    want = _greedy(hf_models[kind])
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        assert _greedy(path, gguf_dequantize=True) == want
    layers = gguf_hf_config(path).num_hidden_layers
    assert f"gguf: {3 * layers} stacked expert tensors (F32 x {3 * layers}) and " in caplog.text
    assert find_converted(path) is not None  # a float32 load keeps a converted copy (per-expert safetensors) ...
    assert _greedy(path, gguf_dequantize=True) == want  # ... which the next start loads
    assert _greedy(path) == want  # the default on a CPU: matrices packed where a kernel reads them (none in F32)


def _packed_kernel() -> None:
    from pagedllm.kernels.cpu import gguf_gemm

    if not gguf_gemm.available():
        pytest.skip("the packed GGUF CPU kernel is not available")


def _experts(model: torch.nn.Module) -> list:
    from pagedllm.layers.fused_moe import MoEExperts

    return [m for m in model.modules() if isinstance(m, MoEExperts)]


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("gguf: ")]


def test_packed_file_keeps_dense_linears_and_experts_packed(hf_models, tmp_path, monkeypatch, caplog) -> None:
    """quantization "gguf" (a CPU's default): attention, the shared expert and the experts stay in Q8_0 blocks, the
    routers are float32; greedy tokens equal the safetensors model of the decoded values."""
    _packed_kernel()
    monkeypatch.setattr(envs, "PAGEDLLM_CACHE", tmp_path / "cache")
    kind, path = "qwen2_moe", str(tmp_path / "m.gguf")
    ref = _reference_dir(hf_models[kind], tmp_path / "ref", write_moe_gguf(hf_models[kind], path, kind, T.Q8_0))
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        model = _load(path, gguf_hf_config(path), "gguf", quantization="gguf")
    lines = _lines(caplog)
    # Per layer q, k, v, o and the shared expert's gate, up, down; then the embedding and the head.
    assert lines[0].startswith("gguf: 16 tensors kept packed (Q8_0 x 16), 0 dequantized;"), lines
    # Per layer the router and the shared expert's gate.
    assert lines[1:] == ["gguf: 6 stacked expert tensors kept packed (Q8_0 x 6; 0.05 MiB held); 4 router tensors "
                         "dequantized to float32 (routers stay in the model's dtype)"]
    mlp = model.model.layers[1].mlp
    assert model.model.layers[1].self_attn.qkv_proj.gguf_segments[0][2] == int(T.Q8_0)
    assert mlp.shared_expert.down_proj.gguf_segments[0][2] == int(T.Q8_0)
    assert mlp.gate.weight.dtype == mlp.shared_expert_gate.weight.dtype == torch.float32
    # 4 experts of 2 x 32 gate/up rows of 64 inputs (two 34-byte Q8_0 blocks), 64 down rows of 32 inputs (one).
    assert (mlp.experts.w13_qweight.dtype, tuple(mlp.experts.w13_qweight.shape)) == (torch.uint8, (4, 64, 68))
    assert (mlp.experts.w2_qweight.dtype, tuple(mlp.experts.w2_qweight.shape)) == (torch.uint8, (4, 64, 34))
    assert not any(t.is_floating_point() for n, t in mlp.experts.named_buffers())
    assert not list(mlp.experts.parameters())
    assert _greedy(path) == _greedy(ref)


# Expert types (gate, up, down): Q8_0 on the 64-wide models, and Q4_K_M's (gate and up Q4_K, down Q6_K) on models
# 256 wide, a k-quant block.
EXPERT_MIXES = {"q8_0": (T.Q8_0, T.Q8_0, T.Q8_0), "q4_k_m": (T.Q4_K, T.Q4_K, T.Q6_K)}
WIDE = {"qwen3_moe": dict(hidden_size=256, moe_intermediate_size=256),
        "qwen2_moe": dict(hidden_size=256, moe_intermediate_size=256),
        "mixtral": dict(hidden_size=256, intermediate_size=256)}


@pytest.fixture(scope="module")
def wide_models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("hf_wide")
    return {kind: make_tiny_model(kind, root / kind, seed=2, **(KINDS[kind][2] | WIDE[kind])) for kind in KINDS}


@pytest.mark.parametrize("mix", sorted(EXPERT_MIXES))
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_packed_experts_match_dequantized_experts(kind: str, mix: str, hf_models, wide_models, tmp_path, monkeypatch,
                                                  caplog) -> None:
    """Experts packed (the CPU default) against the same file dequantized: prefill logits within the dense packed
    linears' tolerance, and the engine's greedy tokens identical."""
    from pagedllm.layers.quantization.gguf import row_bytes

    _packed_kernel()
    monkeypatch.setattr(envs, "PAGEDLLM_CACHE", tmp_path / "cache")
    gate, up, down = EXPERT_MIXES[mix]
    path = str(tmp_path / "m.gguf")
    hf_dir = (wide_models if mix == "q4_k_m" else hf_models)[kind]
    write_moe_gguf(hf_dir, path, kind, T.Q8_0, expert_qtypes=(gate, up, down))
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        packed, mc = load(path, "gguf")
    config, layers = mc.hf_config, mc.hf_config.num_hidden_layers
    h, i = config.hidden_size, getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    experts = _experts(packed)
    assert len(experts) == layers
    for layer in experts:
        e = layer.num_experts
        w13, w2 = layer.w13_qweight, layer.w2_qweight
        assert (w13.dtype, tuple(w13.shape)) == (torch.uint8, (e, 2 * i, row_bytes(gate, h)))
        assert (w2.dtype, tuple(w2.shape)) == (torch.uint8, (e, h, row_bytes(down, i)))
        assert layer.gguf_w13 == (("w13_qweight", int(gate)),) and layer.gguf_w2 == ("w2_qweight", int(down))
    # The experts share the other packed weights' huge-page arena.
    arena = {packed.model.embed_tokens.qweight_data.untyped_storage().data_ptr()}
    assert {t.untyped_storage().data_ptr() for layer in experts for _, t in layer.named_buffers()} == arena
    by_type = ", ".join(f"{t} x {n * layers}" for t, n in Counter([gate.name, up.name, down.name]).most_common())
    assert any(line.startswith(f"gguf: {3 * layers} stacked expert tensors kept packed ({by_type}; ")
               for line in _lines(caplog)), _lines(caplog)
    dense, _ = load(path, None)
    assert _experts(dense)[0].w13_weight.dtype == torch.float32
    assert_relative(prefill_logits(packed, mc, PROMPTS), prefill_logits(dense, mc, PROMPTS))
    del packed, dense
    assert _greedy(path) == _greedy(path, gguf_dequantize=True)


def test_gate_and_up_of_two_types_and_a_type_without_kernel(hf_models, tmp_path, caplog) -> None:
    """Gate and up of different types stay packed apart (two products an expert); down projections of a type the
    kernel does not read are dequantized, and the log says which."""
    from pagedllm.kernels.cpu import gguf_gemm

    _packed_kernel()
    assert int(T.Q4_1) not in gguf_gemm.KERNEL_TYPES
    kind, path = "qwen3_moe", str(tmp_path / "m.gguf")
    write_moe_gguf(hf_models[kind], path, kind, T.Q8_0, expert_qtypes=(T.Q8_0, T.Q5_0, T.Q4_1))
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        packed, mc = load(path, "gguf")
    assert any(line.startswith("gguf: 4 stacked expert tensors kept packed (Q8_0 x 2, Q5_0 x 2; ") and
               line.endswith("held), 2 dequantized to float32 (Q4_1 x 2: no packed kernel for the type); 2 router "
                             "tensors dequantized to float32 (routers stay in the model's dtype)")
               for line in _lines(caplog)), _lines(caplog)
    layer = _experts(packed)[0]
    assert layer.gguf_w13 == (("w1_qweight", int(T.Q8_0)), ("w3_qweight", int(T.Q5_0)))
    assert layer.gguf_w2 == ("w2_qweight", 0)  # F32: dequantized, in the model's dtype
    assert (layer.w1_qweight.dtype, tuple(layer.w1_qweight.shape)) == (torch.uint8, (8, 32, 68))
    assert (layer.w3_qweight.dtype, tuple(layer.w3_qweight.shape)) == (torch.uint8, (8, 32, 44))
    assert (layer.w2_qweight.dtype, tuple(layer.w2_qweight.shape)) == (torch.float32, (8, 64, 32))
    dense, _ = load(path, None)
    assert_relative(prefill_logits(packed, mc, PROMPTS), prefill_logits(dense, mc, PROMPTS))


@pytest.mark.parametrize("kind", ["qwen2_moe", "qwen3_moe"])
def test_transformers_reads_the_same_weights(kind: str, hf_models, tmp_path) -> None:
    """transformers' own GGUF reading (its stacked ``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]) of a Q8_0
    file, with the model skeleton our config describes: its table has no expert widths, the config's only difference."""
    path = str(tmp_path / "m.gguf")
    write_moe_gguf(hf_models[kind], path, kind, T.Q8_0)
    config = gguf_hf_config(path)
    ref_config, ref = _reference_checkpoint(path, config)
    widths = {"moe_intermediate_size"} | ({"shared_expert_intermediate_size"} if kind == "qwen2_moe" else set())
    assert set(_config_diff(config, ref_config)) == widths
    ours = dict(iter_gguf_weights(path))
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}.mlp.experts."
        e = range(config.num_experts)
        gate_up = torch.stack([torch.cat([ours.pop(f"{p}{x}.gate_proj.weight"), ours.pop(f"{p}{x}.up_proj.weight")]) for x in e])
        down = torch.stack([ours.pop(f"{p}{x}.down_proj.weight") for x in e])
        assert torch.equal(gate_up, ref.pop(p + "gate_up_proj")) and torch.equal(down, ref.pop(p + "down_proj"))
    assert ours.keys() == ref.keys()
    for name, w in ours.items():
        assert torch.equal(w, ref[name]), name


def test_expert_parallel_rank_reads_only_its_experts(hf_models, tmp_path, monkeypatch) -> None:
    from pagedllm.model_loader import gguf_experts

    kind, path = "mixtral", str(tmp_path / "m.gguf")
    write_moe_gguf(hf_models[kind], path, kind, T.Q8_0)
    every = dict(iter_gguf_weights(path))
    decoded: list[tuple] = []
    real = gguf_experts.dequantize
    monkeypatch.setattr(gguf_experts, "dequantize", lambda raw, *a: decoded.append(raw.shape) or real(raw, *a))
    ours = dict(iter_gguf_weights(path, experts=range(2, 4)))
    experts = {n for n in ours if ".experts." in n}
    assert {int(n.split(".experts.")[1].split(".")[0]) for n in experts} == {2, 3}
    assert len(experts) == len(decoded) == 2 * 3 * 2  # layers x projections x experts: one expert's rows each
    assert all(len(shape) == 2 for shape in decoded)
    assert ours.keys() - experts == {n for n in every if ".experts." not in n}
    for name, w in ours.items():
        assert torch.equal(w, every[name]), name
    # Packed: the rank's experts' type and rows, nothing decoded.
    decoded.clear()
    rows = dict(iter_gguf_weights(path, experts=range(2, 4), keep_packed=lambda t: True, pack_experts=True))
    kept = {n for n in rows if ".experts." in n}
    assert not decoded and {int(n.split(".experts.")[1].split(".")[0]) for n in kept} == {2, 3}
    assert len(kept) == 2 * 3 * 2 * 2 and all(n.endswith((".qweight", ".qweight_type")) for n in kept)
    w1 = rows["model.layers.1.block_sparse_moe.experts.3.w1.qweight"]
    assert w1.dtype == torch.uint8 and tuple(w1.shape) == (32, 68)  # 32 rows of two Q8_0 blocks


def test_expert_parallel_engine_greedy_tokens_equal_one_process(hf_models, tmp_path, monkeypatch) -> None:
    """Two expert-parallel worker processes (each reading its four experts, attention packed and split over both)
    give one process's tokens."""
    monkeypatch.setattr(envs, "PAGEDLLM_CACHE", tmp_path / "cache")
    kind, path = "qwen3_moe", str(tmp_path / "m.gguf")
    write_moe_gguf(hf_models[kind], path, kind, T.Q8_0)
    assert _greedy(path, tensor_parallel_size=2, enable_expert_parallel=True) == _greedy(path)


def test_tensor_parallel_engine_splits_packed_experts(wide_models, tmp_path, monkeypatch) -> None:
    """Two tensor-parallel worker processes, each holding every expert's half of the gate/up rows and of the down
    rows' blocks (128 of 256 inputs: four Q8_0 blocks), give one process's tokens."""
    _packed_kernel()
    monkeypatch.setattr(envs, "PAGEDLLM_CACHE", tmp_path / "cache")
    kind, path = "qwen3_moe", str(tmp_path / "m.gguf")
    write_moe_gguf(wide_models[kind], path, kind, T.Q8_0)
    assert _greedy(path, tensor_parallel_size=2) == _greedy(path)


def test_data_parallel_cores_share_packed_experts(hf_models, tmp_path, monkeypatch) -> None:
    """Two engine cores holding four packed experts each, one of them without a request (it runs the MoE layers
    over no tokens while the other decodes), give one process's tokens."""
    _packed_kernel()
    monkeypatch.setattr(envs, "PAGEDLLM_CACHE", tmp_path / "cache")
    kind, path = "qwen3_moe", str(tmp_path / "m.gguf")
    write_moe_gguf(hf_models[kind], path, kind, T.Q8_0)
    assert _greedy(path, PROMPTS[:1], data_parallel_size=2, enable_expert_parallel=True) == _greedy(path, PROMPTS[:1])


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_inconsistent_expert_tensor_is_refused_by_name(kind: str, hf_models, tmp_path) -> None:
    path = str(tmp_path / "m.gguf")
    write_moe_gguf(hf_models[kind], path, kind, edit=lambda name, v: v[:-1] if name == "blk.1.ffn_up_exps.weight" else v)
    e = KINDS[kind][2].get("num_experts") or KINDS[kind][2]["num_local_experts"]
    with pytest.raises(ValueError, match=rf"tensor blk\.1\.ffn_up_exps\.weight has shape \[{e - 1}, 32, 64\] "
                                         rf"\(torch order\); expected \[{e}, 32, 64\]"):
        _load(path, gguf_hf_config(path), "gguf")


def test_missing_expert_tensor_is_refused_by_name(hf_models, tmp_path) -> None:
    kind, path = "qwen2_moe", str(tmp_path / "m.gguf")
    write_moe_gguf(hf_models[kind], path, kind, edit=lambda name, v: None if name == "blk.0.ffn_down_exps.weight" else v)
    with pytest.raises(ValueError, match=r"lacks blk\.0\.ffn_down_exps\.weight: every layer of this qwen2moe file "
                                         r"with 4 experts needs its router, stacked experts and shared expert"):
        LLM(model=path, dtype="float32", device="cpu", skip_tokenizer_init=True, max_model_len=256)
