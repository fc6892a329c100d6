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


def _hard_rows(vocab: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows that catch every way an argmax can differ from torch's: ties, NaN, infinities, the last token."""
    gen = torch.Generator().manual_seed(vocab + 1)
    logits = torch.randn(9, vocab, generator=gen).to(dtype)
    logits[1, vocab // 3] = logits[1, vocab - 2] = 1e4  # a tie across chunks: the first index wins
    logits[2, 7] = logits[2, 8] = 1e4  # a tie inside one chunk
    logits[3] = 0.0  # all equal: index 0
    logits[4, vocab // 2] = logits[4, vocab - 1] = float("nan")  # the first NaN counts as the maximum
    logits[5] = float("-inf")  # nothing but -inf: index 0
    logits[6, vocab - 1] = float("inf")  # +inf in the last, partial chunk
    logits[7, 3] = float("inf")
    logits[7, vocab - 5] = float("nan")  # NaN beats +inf
    logits[8, :] = -1e4
    logits[8, vocab - 1] = -1.0  # the very last token
    return logits


@pytest.mark.parametrize("vocab", [151936, 4096 * 3, 4097, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() else []))
def test_triton_argmax_matches_torch(vocab: int, dtype: torch.dtype) -> None:
    # On the CPU the kernels run interpreted (conftest.py); bfloat16 only compiled, on CUDA.
    from pagedllm.kernels.sampling.argmax import argmax_rows_triton, usable

    device = "cuda" if torch.cuda.is_available() else "cpu"
    logits = _hard_rows(vocab, dtype).to(device)
    expected = logits.cpu().argmax(dim=-1)
    assert expected.tolist()[1:9] == [vocab // 3, 7, 0, vocab // 2, 0, vocab - 1, vocab - 5, vocab - 1]
    assert usable(logits)
    got = argmax_rows_triton(logits)
    assert got.dtype == torch.int64 and torch.equal(got.cpu(), expected)
    # A row view of a wider buffer (the LM head's logits sliced to the vocabulary).
    wide = torch.zeros(9, vocab + 64, dtype=dtype, device=device)
    wide[:, :vocab] = logits
    assert torch.equal(argmax_rows_triton(wide[:, :vocab]).cpu(), expected)
    if device == "cuda":
        assert torch.equal(argmax_rows(logits).cpu(), expected)  # the default on CUDA
