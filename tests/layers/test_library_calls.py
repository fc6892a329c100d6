"""layers/library_calls.py: products recorded once per shape key while recording, never otherwise, and on CUDA only."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.layers.library_calls import library_linear, recording_library_calls


def test_library_linear_is_f_linear_and_cpu_calls_are_not_recorded():
    x, w, b = torch.randn(3, 8), torch.randn(5, 8), torch.randn(5)
    with recording_library_calls() as calls:
        out = library_linear(x, w, b)
    assert torch.equal(out, F.linear(x, w, b))
    assert calls == {}  # a CPU product has no kernel to link


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_recording_keeps_one_call_per_shape_key():
    dev = "cuda"
    w1, w2 = torch.randn(16, 8, device=dev), torch.randn(16, 8, device=dev)
    x = torch.randn(4, 8, device=dev)
    library_linear(x, w1, None)  # outside: not recorded anywhere
    with recording_library_calls() as calls:
        library_linear(x, w1, None)
        library_linear(x, w2, None)  # same shapes: same key, the first call kept
        library_linear(x[:2], w1, None)
        library_linear(x, w1, torch.zeros(16, device=dev))
    assert len(calls) == 3
    first = next(iter(calls.values()))
    assert first[1] is w1 and first[2] is None
