"""Gemma 3 parity with HF transformers in float32 on tiny random checkpoints: paged logits and greedy tokens.

The tiny model (``tiny_models`` kind ``gemma3``) has a sliding window of 8, shorter than the
prompts, between global layers with their own (scaled) rotary, so both attention kinds, both rope
bases, the q/k norms, the four (1 + w) norms per layer, the embedding scale, the query_pre_attn_scalar
scale and the logit soft cap all show up in the logits.
"""
from __future__ import annotations

import pytest
import torch
from paged_batches import scattered_block_tables, step_metadata
from tiny_models import make_tiny_model, tiny_config

from pagedllm import LLM, SamplingParams
from pagedllm.attention.registry import get_attn_backend
from pagedllm.config import LoadConfig, ModelConfig
from pagedllm.model_loader.loader import get_model

BLOCK_SIZE = 16
ATOL = 1e-4
MAX_NEW = 12
NUM_LOGPROBS = 3
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    return make_tiny_model("gemma3", tmp_path_factory.mktemp("gemma3"))


@pytest.fixture(scope="module")
def multimodal_dir(tmp_path_factory) -> str:
    """A tiny Gemma3ForConditionalGeneration (vision tower + projector + the tiny text model), as HF saves it."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig

    vision = SiglipVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
    )
    text = tiny_config("gemma3")
    # HF's Gemma3ForConditionalGeneration never soft-caps its logits (real Gemma 3 configs set no cap).
    text.final_logit_softcapping = None
    config = Gemma3Config(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        mm_tokens_per_image=4,
        image_token_index=380,
        boi_token_index=381,
        eoi_token_index=382,
    )
    config.architectures = ["Gemma3ForConditionalGeneration"]
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "language_model" in name and "norm" in name:
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
    path = tmp_path_factory.mktemp("gemma3-mm")
    model.save_pretrained(path)
    return str(path)


def test_paged_forward_matches_hf(tiny_dir):
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.from_pretrained(tiny_dir)
    model_config = ModelConfig(
        model=tiny_dir, tokenizer=None, hf_config=hf_config, dtype=torch.float32, max_model_len=256
    )
    model = get_model(model_config, LoadConfig(), CPU, get_attn_backend("torch_ref", "cpu"))
    assert model.sliding_windows() == [8, None, 8]
    assert model.lm_head.weight is model.model.embed_tokens.weight
    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32, attn_implementation="eager").eval()

    # Step 1 prefills three prompts; step 2 mixes a decode token with two prompt chunks, so every
    # query of step 2 attends to keys cached in step 1, some of them outside its window.
    step1, step2 = [5, 19, 30], [1, 6, 11]
    g = torch.Generator().manual_seed(7)
    seqs = [torch.randint(3, hf_config.vocab_size, (a + b,), generator=g) for a, b in zip(step1, step2)]
    with torch.no_grad():
        expected = [hf(s[None]).logits[0] for s in seqs]  # [n, vocab] per request
    num_blocks = 12
    tables, _ = scattered_block_tables([len(s) for s in seqs], BLOCK_SIZE, g, num_blocks)
    shape = (2, num_blocks, BLOCK_SIZE, model_config.num_kv_heads, model_config.head_size)
    kv_caches = [torch.zeros(shape) for _ in range(model_config.num_layers)]

    for starts, query_lens in [([0, 0, 0], step1), (step1, step2)]:
        positions, md = step_metadata(tables, starts, query_lens, BLOCK_SIZE)
        ids = torch.cat([s[a : a + q] for s, a, q in zip(seqs, starts, query_lens)])
        with torch.no_grad():
            logits = model.compute_logits(model(ids, positions, kv_caches, md))
        for i, (a, q) in enumerate(zip(starts, query_lens)):
            got = logits[md.query_start_loc_cpu[i] : md.query_start_loc_cpu[i + 1]]
            torch.testing.assert_close(got, expected[i][a : a + q], atol=ATOL, rtol=ATOL)


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1234)
    shared = torch.randint(3, vocab, (35,), generator=g).tolist()
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (3, 8, 9, 17, 40)]
    # Two prompts share two full blocks and a bit: prefix-cache hits past the window.
    return prompts + [shared + [5, 6, 7], shared + [9]]


def _hf_greedy(model, prompts: list[list[int]]) -> list[tuple[list[int], list[torch.Tensor]]]:
    expected = []
    for p in prompts:  # one by one: left padding would change HF's float32 results
        with torch.no_grad():
            out = model.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                do_sample=False,
                max_new_tokens=MAX_NEW,
                min_new_tokens=MAX_NEW,
                eos_token_id=None,
                pad_token_id=0,
                output_logits=True,
                return_dict_in_generate=True,
            )
        logprobs = [torch.log_softmax(x[0].float(), -1) for x in out.logits]
        expected.append((out.sequences[0, len(p) :].tolist(), logprobs))
    return expected


def _run(path: str, prompts: list[list[int]], **engine_kwargs) -> list:
    llm = LLM(model=path, dtype="float32", device="cpu", skip_tokenizer_init=True, **engine_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=NUM_LOGPROBS)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _check(outs, expected) -> None:
    for i, (out, (ids, lps)) in enumerate(zip(outs, expected)):
        got = out.outputs[0]
        assert got.token_ids == ids, f"prompt {i} differs from HF"
        for pos, (tok, lp) in enumerate(zip(got.token_ids, got.logprobs)):
            assert abs(lp[tok].logprob - lps[pos][tok].item()) < 1e-3, (i, pos)


@pytest.mark.slow
def test_greedy_matches_hf(tiny_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    prompts = _prompts(hf.config.vocab_size)
    expected = _hf_greedy(hf, prompts)

    outs = _run(tiny_dir, prompts, kv_cache_memory_bytes=1 << 22)
    _check(outs, expected)
    assert outs[-1].num_cached_tokens == 32 or outs[-2].num_cached_tokens == 32
    _check(_run(tiny_dir, prompts, kv_cache_memory_bytes=1 << 22, enable_prefix_caching=False), expected)
    # A budget of 8 tokens forces every prompt longer than 8 into chunks.
    outs = _run(tiny_dir, prompts, kv_cache_memory_bytes=1 << 22, max_num_batched_tokens=8)
    _check(outs, expected)


def test_multimodal_checkpoint_serves_language_model(multimodal_dir):
    from transformers import Gemma3ForConditionalGeneration

    hf = Gemma3ForConditionalGeneration.from_pretrained(multimodal_dir, dtype=torch.float32).eval()
    prompts = _prompts(hf.config.text_config.vocab_size)[-3:]
    _check(_run(multimodal_dir, prompts, kv_cache_memory_bytes=1 << 22), _hf_greedy(hf, prompts))


def test_bidirectional_config_is_refused():
    config = tiny_config("gemma3")
    config.use_bidirectional_attention = True
    config.architectures = ["Gemma3ForCausalLM"]
    model_config = ModelConfig(model="", tokenizer=None, hf_config=config, dtype=torch.float32, max_model_len=64)
    with pytest.raises(NotImplementedError, match="bidirectional"):
        get_model(model_config, LoadConfig(load_format="dummy"), CPU, get_attn_backend("torch_ref", "cpu"))
