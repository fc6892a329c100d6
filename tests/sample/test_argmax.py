"""The two-stage few-row argmax against torch.argmax: first index on ties, NaN as the maximum, odd vocabularies."""
from __future__ import annotations

import pytest
import torch

from pagedllm.sample.argmax import argmax_rows


@pytest.mark.parametrize("vocab", [128256, 151936, 32000, 4096 * 3, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_argmax_matches_torch(vocab: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=gen).to(dtype)
    logits[1, vocab // 3] = logits[1, vocab - 2] = 1e4  # a tie across chunks: the first index wins
    logits[2, 7] = logits[2, 8] = 1e4  # a tie inside one chunk
    logits[3] = 0.0  # all equal: index 0
    logits[4, vocab // 2] = float("nan")  # NaN counts as the maximum, as in torch.argmax
    expected = logits.argmax(dim=-1)
    assert expected.tolist()[1:4] == [vocab // 3, 7, 0]
    assert torch.equal(argmax_rows(logits, chunked=True), expected)
    assert torch.equal(argmax_rows(logits), expected)  # CPU: torch's own argmax


def test_chunked_argmax_on_a_batch_of_one() -> None:
    logits = torch.full((1, 151936), -3.0)
    logits[0, 151935] = 2.0  # the very last token
    assert argmax_rows(logits, chunked=True).tolist() == [151935]
