"""Tiny models whose shapes hit tensor- and pipeline-parallel edge cases, and the single-process reference."""
from __future__ import annotations

import torch
from tiny_models import make_tiny_model

from pagedllm import LLM, SamplingParams

# One KV head (fewer than two ranks: replicated), a vocabulary that two ranks cannot split evenly, an odd
# number of layers (two stages get two and one).
EDGE_SHAPES = dict(num_hidden_layers=3, num_key_value_heads=1, vocab_size=383)
GEMMA_EDGE_SHAPES = dict(EDGE_SHAPES, layer_types=["sliding_attention", "full_attention", "sliding_attention"])
COMMON = dict(dtype="float32", device="cpu", skip_tokenizer_init=True, max_model_len=128, seed=0)
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def make_edge_model(kind: str, path) -> str:
    return make_tiny_model(kind, path, **(GEMMA_EDGE_SHAPES if kind == "gemma3" else EDGE_SHAPES))


def prompts(vocab: int = 383) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(3, vocab, (35,), generator=g).tolist()
    out = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (2, 9, 16, 30)]
    return out + [shared + [11, 12], shared + [13]]  # a shared prefix of two full blocks


def generate(path: str, prompt_ids, params=GREEDY, **kwargs) -> list[list[list[int]]]:
    """Token ids of every completion of every prompt; the engine (and its workers) stopped after."""
    llm = LLM(model=path, **{**COMMON, **kwargs})
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False)
        return [[list(c.token_ids) for c in o.outputs] for o in outs]
    finally:
        llm.llm_engine.shutdown()
