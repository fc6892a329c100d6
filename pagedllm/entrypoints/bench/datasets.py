"""Synthetic benchmark workloads: random token prompts with lengths drawn around a mean."""
from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


def sample_lengths(mean: int, range_ratio: float, n: int, rng: random.Random) -> list[int]:
    """Uniform integers in [mean * (1 - r), mean * (1 + r)], at least 1 (vLLM's random dataset)."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"random_range_ratio must be in [0, 1), got {range_ratio}")
    lo, hi = max(1, int(mean * (1 - range_ratio))), max(1, int(mean * (1 + range_ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def random_requests(
    num_prompts: int,
    input_len: int,
    output_len: int,
    vocab_size: int,
    range_ratio: float = 0.0,
    seed: int = 0,
) -> list[BenchRequest]:
    rng = random.Random(seed)
    in_lens = sample_lengths(input_len, range_ratio, num_prompts, rng)
    out_lens = sample_lengths(output_len, range_ratio, num_prompts, rng)
    # Stay clear of the lowest ids, which are special tokens in most vocabularies.
    lo = min(1000, vocab_size // 4)
    return [
        BenchRequest([rng.randrange(lo, vocab_size) for _ in range(i)], o) for i, o in zip(in_lens, out_lens)
    ]
