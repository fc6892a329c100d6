"""cuBLAS products recorded by shape while a CUDA graph is captured, so their kernels can be checked for PDL.

cuBLAS's products cannot be launched with programmatic dependent launch from Python. A captured graph's
edge into one can be made programmatic afterwards (worker/graph_edges.py), which is safe only for a
kernel that waits on its predecessor before it reads. So while a graph is captured, each distinct
product shape is recorded here, and graph_edges.py checks the kernel cuBLAS picks for it.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F

_CALLS: ContextVar[dict | None] = ContextVar("pagedllm_library_calls", default=None)


def library_linear(
    x: torch.Tensor,  # [T, K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None,  # [N]
) -> torch.Tensor:  # [T, N]
    """``F.linear`` (cuBLAS on CUDA), recorded by shape while ``recording_library_calls`` is active."""
    calls = _CALLS.get()
    if calls is not None and x.is_cuda:
        # cuBLAS picks its kernel from shapes, strides and dtypes, not from the values: one call per key.
        key = (tuple(x.shape), tuple(x.stride()), x.dtype, tuple(weight.shape), tuple(weight.stride()), weight.dtype,
               bias is None)
        calls.setdefault(key, (x, weight, bias))
    return F.linear(x, weight, bias)


@contextmanager
def recording_library_calls() -> Iterator[dict]:
    """Yields {shape key: (an input [T, K], weight [N, K], bias [N] or None)} of the products issued inside."""
    calls: dict = {}
    token = _CALLS.set(calls)
    try:
        yield calls
    finally:
        _CALLS.reset(token)
