"""Perplexity of a token sequence under pagedllm (prompt logprobs) and under a transformers model (one forward),
and greedy continuations of both, for the quantization accuracy tests and ``benchmarks/quant_quality.py``."""
from __future__ import annotations

import math
import os

import torch

TEXT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "data",
                    "declaration_gettysburg.txt")


def text_ids(tokenizer_dir: str, limit: int | None = None) -> list[int]:
    """The shipped public-domain text as token ids (BOS first), at most ``limit`` of them."""
    from transformers import AutoTokenizer

    with open(TEXT, encoding="utf-8") as f:
        ids = AutoTokenizer.from_pretrained(tokenizer_dir)(f.read())["input_ids"]
    return ids[:limit] if limit else ids


def pagedllm_llm(path: str, max_model_len: int, **kw):
    from pagedllm import LLM

    return LLM(model=path, dtype="float32", device="cpu", max_model_len=max_model_len, enable_prefix_caching=False,
               kv_cache_memory_bytes=1 << 28, skip_tokenizer_init=True, **kw)


def pagedllm_perplexity(llm, ids: list[int]) -> float:
    """exp of the mean negative logprob of ids[1:] given their prefixes, from pagedllm's prompt logprobs."""
    from pagedllm import SamplingParams

    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False),
                       use_tqdm=False)[0]
    nll = [-entry[tok].logprob for tok, entry in zip(ids, out.prompt_logprobs) if entry is not None]
    assert len(nll) == len(ids) - 1
    return math.exp(sum(nll) / len(nll))


def pagedllm_greedy(llm, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from pagedllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    return [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                                 use_tqdm=False)]


@torch.no_grad()
def hf_perplexity(model, ids: list[int]) -> float:
    """The same perplexity from a transformers model's logits over the whole sequence at once."""
    logits = model(torch.tensor([ids])).logits[0, :-1].float()  # [T-1, V]
    nll = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="mean")
    return math.exp(nll.item())


@torch.no_grad()
def hf_greedy(model, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy continuations, prompts of one length run as one batch; only the last position's logits computed."""
    tokens: list[list[int]] = [[] for _ in prompts]
    for length in sorted({len(p) for p in prompts}):
        rows = [i for i, p in enumerate(prompts) if len(p) == length]
        ids = torch.tensor([prompts[i] for i in rows])  # [B, L]
        for _ in range(max_tokens):
            logits = model(ids, logits_to_keep=1).logits[:, -1]  # [B, V]
            ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
        for row, i in enumerate(rows):
            tokens[i] = ids[row, length:].tolist()
    return tokens


def hf_greedy_noise_agreement(model, prompts: list[list[int]], max_tokens: int, draws: int = 3) -> int:
    """How many prompts keep the model's greedy tokens when its input embeddings take relative noise of 2^-22 (one
    unit in the last place of float32), the fewest over ``draws`` seeded draws: the agreement that rounding
    differences alone leave, where a model's activations are rounded at run time."""
    clean = hf_greedy(model, prompts, max_tokens)
    emb = model.get_input_embeddings().weight
    fewest = len(prompts)
    with torch.no_grad():
        saved = emb.detach().clone()
        for seed in range(draws):
            noise = torch.rand(emb.shape, generator=torch.Generator().manual_seed(seed)) - 0.5
            emb.mul_(1 + noise * 2.0 ** -21)
            noisy = hf_greedy(model, prompts, max_tokens)
            emb.copy_(saved)
            fewest = min(fewest, sum(a == b for a, b in zip(noisy, clean)))
    return fewest


def prompts_from(ids: list[int], count: int = 16, length: int = 24) -> list[list[int]]:
    """``count`` prompts of ``length`` tokens cut from the text at even steps, each starting with its BOS."""
    step = (len(ids) - length) // count
    return [ids[:1] + ids[1 + i * step : i * step + length] for i in range(count)]
