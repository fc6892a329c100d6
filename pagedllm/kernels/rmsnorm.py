"""Triton RMSNorm with an optional fused residual add: one kernel instead of ~9 torch ops per norm.

The op order is ``pagedllm.layers.norm``'s: the residual add rounds to the input dtype, the
statistics are float32, the normalized row is cast back before a Llama weight multiply (in the
input dtype) or kept float32 through a Gemma ``(1 + w)`` multiply and cast after. Where a float8 or int8 linear
alone consumes the output, the kernel stores it quantized as that linear would quantize it (``row_quant.py``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels.launch import pdl_launch_args, wait_for_previous_kernel
from pagedllm.kernels import row_quant
from pagedllm.kernels.numerics import exact_rounding

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _rmsnorm_kernel(
    x_ptr,  # [R0, R1, H] (or [R0, H] with R1 = 1), last dim contiguous
    res_ptr,  # [R0, R1, H] like x; unused without HAS_RESIDUAL
    w_ptr,  # [H] contiguous
    out_ptr,  # [R0 * R1, H] contiguous
    res_out_ptr,  # [R0 * R1, H] contiguous; unused without HAS_RESIDUAL
    q_ptr,  # [R0 * R1, H] float8 e4m3fn or int8, contiguous; written instead of out with QUANT
    s_ptr,  # [R0 * R1] float32 row scales (QUANT)
    z_ptr,  # [R0 * R1] float32 row zero points (QUANT 3: "int8_zp")
    n_inner,  # R1: rows per outer index (heads for q/k norm, 1 for hidden states)
    stride_x0, stride_x1,
    stride_r0, stride_r1,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    GEMMA: tl.constexpr,
    QUANT: tl.constexpr,  # 0, or row_quant.KINDS' code: store the output row quantized, plus its scale
    EXACT: tl.constexpr,  # compiled NVIDIA code (numerics.exact_rounding), for int8's quantizer
    BLOCK_H: tl.constexpr,  # next power of two >= hidden: the whole row is one tile
    USE_GDC: tl.constexpr,  # launched with PDL: wait for the previous kernel first (kernels/launch.py)
):
    row = tl.program_id(0)
    i0 = row // n_inner
    i1 = row % n_inner
    cols = tl.arange(0, BLOCK_H)  # [BLOCK_H]
    mask = cols < hidden
    # No kernel writes the weight: under PDL it loads while the previous kernel finishes.
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    wait_for_previous_kernel(USE_GDC, True)
    x = tl.load(x_ptr + i0 * stride_x0 + i1 * stride_x1 + cols, mask=mask, other=0.0)  # [BLOCK_H] input dtype
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + i0 * stride_r0 + i1 * stride_r1 + cols, mask=mask, other=0.0)
        # torch adds half tensors in float32 and rounds once; the new residual is that rounded sum.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + row * hidden + cols, x, mask=mask)
    xf = x.to(tl.float32)  # [BLOCK_H]
    var = tl.sum(xf * xf, axis=0) / hidden
    normed = xf * (1.0 / tl.sqrt(var + eps))  # [BLOCK_H] float32
    if GEMMA:
        out = normed * (1.0 + w.to(tl.float32))
    else:
        # Llama casts the normalized row first, then multiplies in the input dtype (one rounding each).
        out = w.to(tl.float32) * normed.to(x.dtype).to(tl.float32)
    if QUANT:
        # The 16-bit output the unfused path would store, quantized as its own quantizer would.
        q, scale, zero = row_quant.quantize_row(out.to(x.dtype).to(tl.float32), mask, QUANT, EXACT)
        tl.store(s_ptr + row, scale)
        if QUANT == 3:
            tl.store(z_ptr + row, zero)
        tl.store(q_ptr + row * hidden + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptr + row * hidden + cols, out.to(x.dtype), mask=mask)


def _rows_view(t: torch.Tensor) -> tuple[torch.Tensor, int, int, int] | None:
    """(tensor, outer stride, inner stride, inner count) addressing t's rows, or None if not expressible."""
    if t.stride(-1) != 1:
        return None
    if t.dim() == 1:
        return t, 0, 0, 1
    if t.dim() == 2:
        return t, t.stride(0), 0, 1
    if t.dim() == 3:
        return t, t.stride(0), t.stride(1), t.shape[1]
    return None


def usable(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> bool:
    """Whether the kernel computes exactly the torch path's op order for these tensors."""
    ok = (
        x.dtype in SUPPORTED_DTYPES
        and weight.dtype == x.dtype  # otherwise torch type-promotes the product
        and weight.dim() == 1
        and weight.is_contiguous()
        and x.numel() > 0
        and _rows_view(x) is not None
    )
    if residual is not None:
        ok = ok and residual.shape == x.shape and residual.dtype == x.dtype and _rows_view(residual) is not None
    return ok


def rms_norm(
    x: torch.Tensor,  # [..., H] (at most 3 dims), last dim contiguous
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # like x
    gemma: bool = False,
    quantize: str | None = None,  # x [T, H]: return the output as QuantizedRows of this kind (row_quant.KINDS)
) -> tuple:  # out [..., H] (or QuantizedRows) (and new residual [..., H])
    hidden = x.shape[-1]
    rows = x.numel() // hidden
    xv, sx0, sx1, n_inner = _rows_view(x)
    if quantize:
        assert x.dim() == 2, "quantized output is for [T, H] hidden states"
        out = row_quant.empty_rows(quantize, rows, hidden, x.dtype, x.device)
        out_t, q_t, s_t = x, out.q, out.scales  # out_t: never written with QUANT
        z_t = out.zeros if out.zeros is not None else s_t
    else:
        out = out_t = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        q_t = s_t = z_t = out
    if residual is not None:
        rv, sr0, sr1, _ = _rows_view(residual)
        res_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    else:
        rv, sr0, sr1, res_out = xv, 0, 0, out_t
    block = triton.next_power_of_2(hidden)
    # Wide rows (hidden states) get more warps so each thread holds a few elements; head-dim rows need few.
    num_warps = 8 if block >= 4096 else (4 if block >= 1024 else (2 if block >= 256 else 1))
    _rmsnorm_kernel[(rows,)](
        xv, rv, weight, out_t, res_out, q_t, s_t, z_t,
        n_inner, sx0, sx1, sr0, sr1, hidden, eps,
        HAS_RESIDUAL=residual is not None,
        GEMMA=gemma,
        QUANT=row_quant.KINDS[quantize] if quantize else 0,
        EXACT=exact_rounding(x),
        BLOCK_H=block,
        num_warps=num_warps,
        **pdl_launch_args(x),
    )
    return out if residual is None else (out, res_out)
