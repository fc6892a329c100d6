"""Token-exact parity on the real Gemma 3 270M Q4_K_M GGUF: pagedllm's greedy tokens equal HF transformers'.

HF reads the same file itself (``from_pretrained(dir, gguf_file=name)``: its own config, its own
dequantization), so the comparison covers the GGUF loader (names, dequantization, the ``+ 1`` folded
into Gemma norms), the tokenizer ids and the model (embedding scale, q/k norms, 4 norms per layer,
attention scale, local/global rotary, the 512-token sliding window), with prefix-cache hits,
chunked prefill and prompts longer than the window.
"""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("gguf")
# A few minutes on 2 CPU cores: the real model, HF's own GGUF parsing and 10 HF generate calls.
pytestmark = pytest.mark.slow

from pagedllm import LLM, SamplingParams  # noqa: E402

MAX_NEW = 20
VARIED = (
    "The capital of France is",
    "def fibonacci(n):\n",
    "Translate to German: Good morning, how are you?\nGerman:",
    "Q: What is 12 times 7?\nA:",
    "<!DOCTYPE html>\n<html>\n<head>\n<title>",
)
SHARED_PREFIX = (
    "The following is a short encyclopedia entry about the history of the printing press, written for "
    "students. The printing press was invented around 1440 by Johannes Gutenberg, a goldsmith from Mainz. "
)
SHARED = tuple(
    SHARED_PREFIX + s
    for s in ("Its most important effect was", "Before its invention, books were", "The first major book printed was")
)
_ITEMS = " ".join(
    f"Item {i}: the {('red', 'blue', 'green', 'old', 'new')[i % 5]} box holds {3 * i} marbles." for i in range(40)
)
# Both past the 512-token window, sharing all but their last words: the second one's prefix-cache
# hit reaches beyond the window of its sliding layers.
LONG = (_ITEMS + " Summary:", _ITEMS + " In total, the boxes hold")
WINDOW = 512


@pytest.fixture(scope="module")
def gguf_path() -> str:
    from pagedllm.model_loader.default_model import default_model_path

    try:
        return default_model_path()
    except RuntimeError as e:  # the model package is not installed
        pytest.skip(str(e))


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # On a 2-core machine shared with other jobs, two OpenMP threads spin-wait on each other and
    # make the small decode matmuls 10-30x slower; one thread keeps the module within minutes.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def reference(gguf_path):
    """Prompt ids (HF's GGUF tokenizer) and HF's greedy continuations, from one HF model for the module."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from pagedllm.model_loader.gguf_tokenizer import gguf_tokenizer

    folder, name = os.path.dirname(gguf_path), os.path.basename(gguf_path)
    # Parsed once and handed to from_pretrained, which would otherwise parse the 262k-token metadata again.
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, config=config, dtype=torch.float32).eval()
    tokenizer = gguf_tokenizer(gguf_path)

    texts = VARIED + SHARED + LONG
    prompt_ids = [tokenizer(t).input_ids for t in texts]
    expected = {}
    for text, ids in zip(texts, prompt_ids):
        # One prompt at a time: left padding changes HF's float32 results.
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                do_sample=False,
                max_new_tokens=MAX_NEW,
                min_new_tokens=MAX_NEW,
                eos_token_id=None,
                pad_token_id=config.pad_token_id,
            )
        expected[text] = (ids, out[0, len(ids) :].tolist())
    return config, expected


def _llm(path: str, **kwargs) -> LLM:
    return LLM(model=path, dtype="float32", device="cpu", max_model_len=1024, kv_cache_memory_bytes=1 << 27, **kwargs)


def _check(outs, texts, expected) -> None:
    for text, out in zip(texts, outs):
        ids, want = expected[text]
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == want, f"prompt {text[:40]!r}...: tokens differ from HF"


def test_config_matches_hf(gguf_path, reference):
    from pagedllm.model_loader.gguf_loader import gguf_hf_config

    hf_config, _ = reference
    ours = gguf_hf_config(gguf_path)
    for key in (
        "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
        "intermediate_size", "vocab_size", "rms_norm_eps", "query_pre_attn_scalar", "sliding_window",
        "layer_types", "rope_parameters", "final_logit_softcapping", "hidden_activation", "tie_word_embeddings",
    ):
        assert getattr(ours, key) == getattr(hf_config, key), key
    assert ours.sliding_window == WINDOW and "full_attention" in ours.layer_types


def test_greedy_matches_hf(gguf_path, reference):
    _, expected = reference
    # Straight from the GGUF, its weights kept in their quantized blocks.
    llm = _llm(gguf_path, load_format="gguf")
    assert llm.llm_engine.config.model_config.quantization == "gguf"
    texts = VARIED + SHARED + LONG
    # Text prompts: the engine's own tokenizer must produce HF's ids (BOS included).
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate(list(texts), params, use_tqdm=False)
    _check(outs, texts, expected)
    assert len(outs[-1].prompt_token_ids) > WINDOW
    cached = {t: o.num_cached_tokens for t, o in zip(texts, outs)}
    assert all(cached[t] > 0 for t in SHARED[1:]) and cached[LONG[1]] > WINDOW


def test_chunked_prefill_with_prefix_hits(gguf_path, reference):
    _, expected = reference
    # A budget of 16 tokens: every prompt is prefilled in chunks, the long ones in dozens of them.
    # The dense path (every tensor dequantized), whose first float32 load writes the converted cache.
    llm = _llm(gguf_path, skip_tokenizer_init=True, max_num_batched_tokens=16, gguf_dequantize=True)
    assert llm.llm_engine.config.model_config.quantization is None
    texts = VARIED[:2] + SHARED + LONG
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": expected[t][0]} for t in texts], params, use_tqdm=False)
    _check(outs, texts, expected)
    cached = {t: o.num_cached_tokens for t, o in zip(texts, outs)}
    assert all(cached[t] > 0 for t in SHARED[1:]) and cached[LONG[1]] > WINDOW
    # With the converted cache in place the dense path loads its safetensors; the packed one still reads the file.
    from pagedllm import EngineArgs

    dense = EngineArgs(model=gguf_path, device="cpu", gguf_dequantize=True).create_engine_config()
    assert dense.load_config.load_format == "safetensors" and dense.model_config.quantization is None
    packed = EngineArgs(model=gguf_path, device="cpu").create_engine_config()
    assert packed.load_config.load_format == "gguf" and packed.model_config.quantization == "gguf"
