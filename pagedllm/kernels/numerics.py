"""Float arithmetic for Triton kernels that promise torch's rounding: products and sums the compiler may not fuse.

Triton compiles with floating-point contraction on, so ``a * b + c`` may become one fused multiply-add,
which rounds once where torch's elementwise ops round twice. Worse, a product of two half-precision
values that is cast back to half is narrowed to a half multiply, and that multiply then fuses with a
following half add. A kernel that must give torch's bits (the rotary embedding: each product and the
sum rounded to the activation dtype) uses ``rope_combine`` with ``EXACT`` set from ``exact_rounding``:
then every product and sum is a round-to-nearest instruction that the compiler leaves alone. The
interpreter computes op by op in numpy and never contracts, so there ``EXACT`` is off.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

from pagedllm.kernels.launch import triton_interpreted


def _compiled_for_nvidia(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.version.hip is None and not triton_interpreted()


def exact_rounding(t: torch.Tensor) -> bool:
    """The ``EXACT`` constexpr for a kernel over ``t``: compiled NVIDIA code needs the explicit instructions."""
    return _compiled_for_nvidia(t)


@triton.jit
def mul_rn(a, b, EXACT: tl.constexpr):
    if EXACT:
        return libdevice.mul_rn(a, b)
    else:
        return a * b


@triton.jit
def add_rn(a, b, EXACT: tl.constexpr):
    if EXACT:
        return libdevice.add_rn(a, b)
    else:
        return a + b


@triton.jit
def div_rn(a, b, EXACT: tl.constexpr):
    # Triton's own float32 division is an approximate instruction; torch's is correctly rounded.
    if EXACT:
        return libdevice.div_rn(a, b)
    else:
        return a / b


@triton.jit
def rope_combine(x, partner, cos, sin, DT: tl.constexpr, EXACT: tl.constexpr):
    """``x * cos + partner * sin`` as DT, each product and the sum rounded to DT (torch's half ops).

    All four inputs are float32 tensors holding DT values (``sin`` already carries rotate_half's sign).
    """
    a = mul_rn(x, cos, EXACT).to(DT).to(tl.float32)
    b = mul_rn(partner, sin, EXACT).to(DT).to(tl.float32)
    return add_rn(a, b, EXACT).to(DT)


@triton.jit
def norm_weight(normed, w, GEMMA: tl.constexpr, DT: tl.constexpr):
    """An RMSNorm's weighting of float32 ``normed`` by float32 ``w`` in torch's order, as float32 holding a DT value.

    Llama style casts the normalized value to DT, then multiplies by the weight (one rounding each);
    Gemma style multiplies by ``1 + w`` in float32 and casts once.
    """
    if GEMMA:
        out = normed * (1.0 + w)
    else:
        out = w * normed.to(DT).to(tl.float32)
    return out.to(DT).to(tl.float32)
