"""Triton gated activations ``act(gate) * up`` over a fused ``[gate | up]`` row: SiLU and GELU (tanh or erf) in one kernel.

A second kernel hands the rows to a float8 or int8 linear already quantized (``row_quant.QuantizedRows``): one
program a row holds the row's products whole (up to ``launch.WHOLE_ROW_MAX`` of them; a longer row computes them
twice, once for its largest magnitude and once to quantize them), so the 16-bit product is never written.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels import row_quant
from pagedllm.kernels.numerics import exact_rounding
from pagedllm.kernels.launch import pdl_launch_args, row_tile, wait_for_previous_kernel

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _gated_product(row_ptr, cols, mask, n_cols, ACT: tl.constexpr):
    """act(gate) * up at ``cols`` of one [gate | up] row, in float32 but rounded as torch rounds in the input type."""
    g_raw = tl.load(row_ptr + cols, mask=mask, other=0.0)  # [BLOCK] input dtype
    u = tl.load(row_ptr + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    g = g_raw.to(tl.float32)
    if ACT == 0:
        a = g / (1.0 + tl.exp(-g))
    elif ACT == 1:
        # sqrt(2/pi) and 0.044715: the constants of torch's tanh GELU.
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        # tanh(y) = 1 - 2 / (exp(2y) + 1): exact limits at +-inf, no libdevice needed.
        t = 1.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0)
        a = 0.5 * g * (1.0 + t)
    else:
        a = 0.5 * g * (1.0 + tl.math.erf(g * 0.7071067811865476))
    # torch rounds act(gate) to the input dtype before the multiply, then rounds the product.
    a = a.to(g_raw.dtype).to(tl.float32)
    return (a * u).to(g_raw.dtype).to(tl.float32)


@triton.jit
def _act_and_mul_kernel(
    x_ptr,  # [T, 2F], last dim contiguous
    out_ptr,  # [T, F] contiguous
    n_cols,  # F
    stride_xt,
    ACT: tl.constexpr,  # 0 silu, 1 gelu tanh, 2 gelu erf
    BLOCK: tl.constexpr,
    USE_GDC: tl.constexpr,  # launched with PDL: wait for the previous kernel first (kernels/launch.py)
):
    wait_for_previous_kernel(USE_GDC, True)
    tok = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    mask = cols < n_cols
    out = _gated_product(x_ptr + tok * stride_xt, cols, mask, n_cols, ACT)
    tl.store(out_ptr + tok * n_cols + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _act_and_mul_quant_kernel(
    x_ptr,  # [T, 2F], last dim contiguous
    q_ptr,  # [T, F] float8 e4m3fn or int8, contiguous
    s_ptr,  # [T] float32 row scales
    z_ptr,  # [T] float32 row zero points (QUANT 3: "int8_zp")
    n_cols,  # F
    stride_xt,
    ACT: tl.constexpr,
    BLOCK: tl.constexpr,
    WHOLE_ROW: tl.constexpr,  # BLOCK >= F: the products are computed once (launch.row_tile)
    QUANT: tl.constexpr,  # row_quant.KINDS' code of q's type
    EXACT: tl.constexpr,  # compiled NVIDIA code (numerics.exact_rounding), for int8's quantizer
    USE_GDC: tl.constexpr,
):
    wait_for_previous_kernel(USE_GDC, False)
    tok = tl.program_id(0)
    row_ptr = x_ptr + tok * stride_xt
    # The consumer's quantizer's arithmetic over the 16-bit products the unfused kernel would store.
    if WHOLE_ROW:
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        q, scale, zero = row_quant.quantize_row(_gated_product(row_ptr, cols, mask, n_cols, ACT), mask, QUANT,
                                                EXACT)
        tl.store(q_ptr + tok * n_cols + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    else:
        lo = tl.zeros([BLOCK], dtype=tl.float32)  # masked products are 0, which the range holds anyway
        hi = tl.zeros([BLOCK], dtype=tl.float32)
        for c0 in range(0, n_cols, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            prod = _gated_product(row_ptr, cols, cols < n_cols, n_cols, ACT)
            lo = tl.minimum(lo, prod)
            hi = tl.maximum(hi, prod)
        scale, zero = row_quant.params_of(tl.min(lo, axis=0), tl.max(hi, axis=0), QUANT, EXACT)
        for c0 in range(0, n_cols, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            mask = cols < n_cols
            q = row_quant.quantized(_gated_product(row_ptr, cols, mask, n_cols, ACT), scale, zero, QUANT, EXACT)
            tl.store(q_ptr + tok * n_cols + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + tok, scale)
    if QUANT == 3:
        tl.store(z_ptr + tok, zero)


_ACTS = {"silu": 0, "gelu_tanh": 1, "gelu": 2}


def usable(x: torch.Tensor) -> bool:
    return x.dtype in SUPPORTED_DTYPES and x.dim() == 2 and x.stride(-1) == 1 and x.shape[-1] % 2 == 0 and x.numel() > 0


def act_and_mul(
    x: torch.Tensor,  # [T, 2F]
    act: str = "silu",
    quantize: str | None = None,  # return the rows as QuantizedRows of this kind (row_quant.KINDS)
):  # [T, F] (or QuantizedRows)
    tokens, n_cols = x.shape[0], x.shape[1] // 2
    if quantize:
        out = row_quant.empty_rows(quantize, tokens, n_cols, x.dtype, x.device)
        block, whole_row, warps = row_tile(n_cols)
        zeros = out.zeros if out.zeros is not None else out.scales
        _act_and_mul_quant_kernel[(tokens,)](x, out.q, out.scales, zeros, n_cols, x.stride(0), ACT=_ACTS[act],
                                             BLOCK=block, WHOLE_ROW=whole_row, QUANT=row_quant.KINDS[quantize],
                                             EXACT=exact_rounding(x), num_warps=warps, **pdl_launch_args(x))
        return out
    out = torch.empty((tokens, n_cols), dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(n_cols))
    grid = (tokens, triton.cdiv(n_cols, block))
    _act_and_mul_kernel[grid](x, out, n_cols, x.stride(0), ACT=_ACTS[act], BLOCK=block, num_warps=4, **pdl_launch_args(x))
    return out
