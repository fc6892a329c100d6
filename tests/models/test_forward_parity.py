"""Model parity with HF transformers in float32: paged prefill, decode and chunked steps on the torch_ref backend."""
from __future__ import annotations

import json
import os

import pytest
import torch
from paged_batches import scattered_block_tables, step_metadata
from tiny_models import TINY_KINDS, make_tiny_model, tiny_config

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.registry import get_attn_backend
from pagedllm.config import LoadConfig, ModelConfig
from pagedllm.model_loader.loader import get_model

BLOCK_SIZE = 16
PROMPT_LENS = [5, 17, 33]
# After the prompts: a decode step (1 token each), then a mixed step of chunks and a decode.
STEPS = [[1, 1, 1], [3, 1, 5]]
ATOL = 1e-4
CPU = torch.device("cpu")
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _model_config(path: str | None, hf_config=None, max_model_len: int = 512) -> ModelConfig:
    from transformers import AutoConfig

    return ModelConfig(
        model=path or "",
        tokenizer=None,
        hf_config=hf_config if hf_config is not None else AutoConfig.from_pretrained(path),
        dtype=torch.float32,
        max_model_len=max_model_len,
    )


class PagedBatcher:
    """Builds AttentionMetadata for requests whose blocks are scattered over a shared cache."""

    def __init__(self, total_lens: list[int], num_blocks: int, seed: int = 0, device: str = "cpu") -> None:
        self.device = torch.device(device)
        g = torch.Generator().manual_seed(seed)
        self.tables, _ = scattered_block_tables(total_lens, BLOCK_SIZE, g, num_blocks)
        self.lens = [0] * len(total_lens)

    def step(self, query_lens: list[int]) -> tuple[torch.Tensor, AttentionMetadata]:
        positions, md = step_metadata(self.tables, self.lens, query_lens, BLOCK_SIZE, self.device)
        self.lens = [n + q for n, q in zip(self.lens, query_lens)]
        return positions, md


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    cache: dict[str, str] = {}

    def get(kind: str) -> str:
        if kind not in cache:
            cache[kind] = make_tiny_model(kind, tmp_path_factory.mktemp(kind))
        return cache[kind]

    return get


def _kv_caches(model_config: ModelConfig, num_blocks: int, device: str = "cpu") -> list[torch.Tensor]:
    shape = (2, num_blocks, BLOCK_SIZE, model_config.num_kv_heads, model_config.head_size)
    return [torch.zeros(shape, dtype=model_config.dtype, device=device) for _ in range(model_config.num_layers)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", TINY_KINDS)
def test_paged_forward_matches_hf(kind, device, tiny_dir):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    path = tiny_dir(kind)
    model_config = _model_config(path)
    backend = get_attn_backend("torch_ref", device)
    model = get_model(model_config, LoadConfig(load_format="auto"), torch.device(device), backend)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()

    total = [n + sum(s[i] for s in STEPS) for i, n in enumerate(PROMPT_LENS)]
    g = torch.Generator().manual_seed(7)
    seqs = [torch.randint(3, model_config.vocab_size, (n,), generator=g) for n in total]
    with torch.no_grad():
        expected = [hf(s[None]).logits[0] for s in seqs]  # [n, vocab] per request

    num_blocks = sum(-(-n // BLOCK_SIZE) for n in total) + 3
    kv_caches = _kv_caches(model_config, num_blocks, device)
    batcher = PagedBatcher(total, num_blocks, device=device)
    for step, query_lens in enumerate([PROMPT_LENS, *STEPS]):
        starts = list(batcher.lens)
        positions, md = batcher.step(query_lens)
        input_ids = torch.cat([seqs[i][s : s + q] for i, (s, q) in enumerate(zip(starts, query_lens))])
        with torch.no_grad():
            hidden = model(input_ids.to(device), positions, kv_caches, md)
            logits = model.compute_logits(hidden).cpu()
        assert hidden.shape == (md.num_actual_tokens, model_config.hf_config.hidden_size)
        assert logits.dtype == torch.float32
        for i, (s, q) in enumerate(zip(starts, query_lens)):
            got = logits[md.query_start_loc_cpu[i] : md.query_start_loc_cpu[i + 1]]
            torch.testing.assert_close(
                got, expected[i][s : s + q], atol=ATOL, rtol=ATOL, msg=lambda m: f"{kind} step {step} req {i}: {m}"
            )


def test_sliding_windows_per_layer(tiny_dir):
    for kind, window in [("mistral", 10), ("llama", None), ("qwen2", None)]:
        config = _model_config(tiny_dir(kind))
        model = get_model(config, LoadConfig(load_format="dummy"), CPU, get_attn_backend("torch_ref", "cpu"))
        assert model.sliding_windows() == [window] * config.num_layers


def test_tied_head_shares_embedding(tiny_dir):
    model_config = _model_config(tiny_dir("llama-tied"))
    model = get_model(model_config, LoadConfig(), CPU, get_attn_backend("torch_ref", "cpu"))
    assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dummy_load_from_config_alone(dtype, device):
    hf_config = tiny_config("qwen3")
    hf_config.architectures = ["Qwen3ForCausalLM"]
    model_config = ModelConfig(model="", tokenizer=None, hf_config=hf_config, dtype=dtype, max_model_len=512)
    backend = get_attn_backend("torch_ref", device)
    a = get_model(model_config, LoadConfig(load_format="dummy"), torch.device(device), backend)
    b = get_model(model_config, LoadConfig(load_format="dummy"), torch.device(device), backend)
    assert not a.training and torch.get_default_dtype() == torch.float32
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert pa.dtype == dtype and pa.device.type == device and pa.abs().max() <= 1e-3, name
        assert torch.equal(pa, pb), name
    assert all(buf.dtype == torch.float32 for buf in a.buffers())  # rotary frequencies stay exact
    batcher = PagedBatcher([7], num_blocks=2, device=device)
    positions, md = batcher.step([7])
    with torch.no_grad():
        hidden = a(torch.arange(7, device=device), positions, _kv_caches(model_config, 2, device), md)
        logits = a.compute_logits(hidden)
    assert hidden.dtype == dtype and logits.dtype == torch.float32
    assert logits.shape == (7, model_config.vocab_size) and torch.isfinite(logits).all()


@pytest.mark.parametrize("quant_cfg", [
    {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"},
    {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True},
], ids=["awq", "gptq"])
def test_dummy_load_of_a_quantized_config_builds_its_format(quant_cfg):
    """Random weights for a quantized model's shape take the format's packed linears, as its checkpoint
    would: the benchmarks time AWQ/GPTQ shapes this way."""
    from pagedllm.layers.quantization.base import QuantizedLinearMethod

    hf_config = tiny_config("llama")
    hf_config.architectures = ["LlamaForCausalLM"]
    hf_config.quantization_config = quant_cfg
    model_config = ModelConfig(model="", tokenizer=None, hf_config=hf_config, dtype=torch.float32, max_model_len=512)
    model = get_model(model_config, LoadConfig(load_format="dummy"), CPU, get_attn_backend("torch_ref", "cpu"))
    methods = {type(m.quant_method).__name__ for m in model.modules()
               if isinstance(getattr(m, "quant_method", None), QuantizedLinearMethod)}
    assert methods, "no linear took the checkpoint's quantization method"
    packed = [p for p in model.parameters()] + [m.wna16.qrows for m in model.modules() if hasattr(m, "wna16")
                                                 and hasattr(m.wna16, "qrows")]  # the CPU kernel's rows
    assert any(p.dtype == torch.int32 for p in packed)  # packed 4-bit words
    batcher = PagedBatcher([7], num_blocks=2, device="cpu")
    positions, md = batcher.step([7])
    with torch.no_grad():
        logits = model.compute_logits(model(torch.arange(7), positions, _kv_caches(model_config, 2, "cpu"), md))
    assert logits.shape == (7, model_config.vocab_size) and torch.isfinite(logits).all()


def test_sharded_and_pt_checkpoints_load_the_same(tiny_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    src = tiny_dir("phi3")
    state = load_file(os.path.join(src, "model.safetensors"))
    names = sorted(state)
    sharded, pt = tmp_path / "sharded", tmp_path / "pt"
    for d in (sharded, pt):
        d.mkdir()
        for f in ("config.json",):
            (d / f).write_text(open(os.path.join(src, f)).read())
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for fname, keys in halves.items():
        save_file({k: state[k] for k in keys}, str(sharded / fname))
        weight_map.update({k: fname for k in keys})
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    # A stray file outside the index must be ignored.
    save_file({"junk": torch.zeros(1)}, str(sharded / "consolidated.safetensors"))
    torch.save(state, str(pt / "pytorch_model.bin"))

    backend = get_attn_backend("torch_ref", "cpu")
    ref = get_model(_model_config(src), LoadConfig(), CPU, backend).state_dict()
    for path, fmt in [(sharded, "safetensors"), (pt, "pt"), (pt, "auto")]:
        got = get_model(_model_config(str(path)), LoadConfig(load_format=fmt), CPU, backend).state_dict()
        assert got.keys() == ref.keys()
        for k in ref:
            assert torch.equal(got[k], ref[k]), (fmt, k)


def test_unknown_architecture_lists_supported():
    from pagedllm.models.registry import get_model_class

    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        get_model_class("NoSuchForCausalLM")


def test_unknown_load_format():
    with pytest.raises(ValueError, match="dummy"):
        config = _model_config(None, tiny_config("llama"))
        get_model(config, LoadConfig(load_format="nope"), CPU, get_attn_backend("torch_ref", "cpu"))


def test_hub_unreachable_message(monkeypatch, tmp_path):
    from pagedllm.model_loader.hub import resolve_model_path

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(RuntimeError) as e:
        resolve_model_path("pagedllm-tests/surely-not-a-local-dir", download_dir=str(tmp_path))
    msg = str(e.value)
    assert "\n" not in msg
    assert "not a local path" in msg and "could not be reached" in msg


def test_hub_local_path_used_as_is(tmp_path):
    from pagedllm.model_loader.hub import resolve_model_path

    assert resolve_model_path(str(tmp_path)) == str(tmp_path)


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_output_rows_carry_only_those_rows_through_the_last_layer(kind, tiny_dir):
    model_config = _model_config(tiny_dir(kind))
    model = get_model(model_config, LoadConfig(load_format="auto"), CPU, get_attn_backend("torch_ref", "cpu"))
    g = torch.Generator().manual_seed(3)
    input_ids = torch.randint(3, model_config.vocab_size, (sum(PROMPT_LENS),), generator=g)
    num_blocks = sum(-(-n // BLOCK_SIZE) for n in PROMPT_LENS) + 3
    runs = []
    rows = torch.tensor([4, 21, 54, 0], dtype=torch.int64)  # any rows, in any order
    for output_rows in (None, rows):
        kv_caches = _kv_caches(model_config, num_blocks)
        positions, md = PagedBatcher(PROMPT_LENS, num_blocks).step(PROMPT_LENS)
        with torch.no_grad():
            runs.append((model(input_ids, positions, kv_caches, md, output_rows), kv_caches))
    (full, full_caches), (pruned, pruned_caches) = runs
    assert pruned.shape == (len(rows), model_config.hf_config.hidden_size)
    torch.testing.assert_close(pruned, full[rows], atol=1e-5, rtol=1e-5)
    # Every token's keys and values still reach the cache, the last layer's included.
    assert all(torch.equal(a, b) for a, b in zip(full_caches, pruned_caches))
