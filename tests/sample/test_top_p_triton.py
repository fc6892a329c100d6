"""The Triton top-k/top-p threshold search against the full-sort reference; on CPU it runs in Triton's interpreter."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not importable")

from pagedllm.kernels.sampling.top_p import top_k_top_p_triton_  # noqa: E402
from pagedllm.sample.truncation import sorted_threshold_  # noqa: E402

# The interpreter itself trips a NumPy deprecation on every scalar index; it says nothing about our code.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# The interpreter is slow; a GPU takes a real vocabulary.
VOCAB = 151936 if DEVICE.type == "cuda" else 9000  # several chunks of 4096


@pytest.mark.parametrize("scale", [0.05, 3.0, 12.0])
def test_kernel_keeps_what_the_full_sort_keeps(scale):
    g = torch.Generator().manual_seed(int(scale * 100) + 1)
    V = VOCAB
    # bf16-rounded values: many ties, also at the thresholds; -inf tokens and a -0.0 as well.
    logits = (torch.randn(6, V, generator=g) * scale).to(torch.bfloat16).float()
    logits[0, :100] = float("-inf")
    logits[3, 5] = -0.0
    top_k = torch.tensor([V, 40, V, 2000, 7, V])
    top_p = torch.tensor([0.9, 0.5, 1.0, 0.95, 1.0, 0.3])
    got = top_k_top_p_triton_(logits.clone().to(DEVICE), top_k.to(DEVICE), top_p.to(DEVICE)).cpu()
    ref = logits.clone()
    threshold = sorted_threshold_(ref, top_k, top_p)
    ref.masked_fill_((ref < threshold) & (top_p < 1.0).unsqueeze(1), float("-inf"))
    assert torch.equal(torch.isinf(got), torch.isinf(ref))
    assert torch.equal(got[~torch.isinf(got)], logits[~torch.isinf(got)])  # kept values untouched
    assert (~torch.isinf(got[2])).sum() == V  # nothing asked, nothing dropped
    assert (~torch.isinf(got[4])).sum() >= 7  # top-k alone keeps k (and its ties)


def test_top_p_only_rows_without_top_k():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 5000, generator=g) * 2
    top_p = torch.tensor([0.8, 1.0, 0.05])
    got = top_k_top_p_triton_(logits.clone().to(DEVICE), None, top_p.to(DEVICE)).cpu()
    ref = logits.clone()
    ref.masked_fill_((ref < sorted_threshold_(ref, None, top_p)) & (top_p < 1.0).unsqueeze(1), float("-inf"))
    assert torch.equal(torch.isinf(got), torch.isinf(ref))
    assert (~torch.isinf(got[2])).sum() >= 1  # the top token always stays
