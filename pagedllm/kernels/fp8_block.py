"""Triton products of block-wise float8 linears (DeepSeek-V3 / Qwen3-FP8 checkpoints) on the GPU.

The weight is float8 e4m3 [N, K] with one float32 scale per block of ``bn`` x ``bk`` weights,
``w = q * s[n // bn, k // bk]``. The activations are quantized to float8 per token and group of ``bk`` input
channels (``quantize_groups``: the arithmetic of ``layers.quantization.fp8_block.fp8_group_quant_dequant``, bit
for bit), so each ``bk``-deep step of the product is one float8 tensor-core dot whose float32 sum is scaled by
the token's group scale times the weight block's scale before it joins the accumulator. Checkpoints that keep
their activations in 16 bits take the weight tiles upcast instead. On Triton's interpreter (no float8 dot) the
float8 operands are upcast to float32, which holds their products exactly.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pagedllm.kernels.launch import triton_interpreted

FP8_MAX = tl.constexpr(448.0)
INV_FP8_MAX = tl.constexpr(float(torch.tensor(1.0) / torch.tensor(448.0)))  # its float32 reciprocal
EPS = tl.constexpr(torch.finfo(torch.float32).eps)  # a zero group's scale, as the torch path sets it


@triton.jit
def _quant_groups_kernel(
    x_ptr,  # [M, K], last dim contiguous
    q_ptr,  # [M, K] float8 e4m3fn, contiguous
    s_ptr,  # [M, G] float32 (row-major, or column-major for cuBLAS)
    K, G, stride_xm, stride_sm, stride_sg,
    GROUP: tl.constexpr, BLOCK: tl.constexpr,
    RECIPROCAL: tl.constexpr,  # torch on CUDA divides by a scalar as a product with its float32 reciprocal
):
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    cols = g * GROUP + offs
    mask = (offs < GROUP) & (cols < K)
    x = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=0)
    if RECIPROCAL:
        scale = amax * INV_FP8_MAX
    else:
        scale = tl.math.div_rn(amax, FP8_MAX)  # IEEE divisions, as torch's on the CPU
    scale = tl.where(scale == 0.0, EPS, scale)
    q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FP8_MAX), FP8_MAX)
    tl.store(q_ptr + row * K + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * stride_sm + g * stride_sg, scale)


def quantize_groups(
    x: torch.Tensor,  # [M, K] 16/32-bit
    group: int,
    rows_minor: bool = False,  # scales stored column-major (each group's scales contiguous over rows), as cuBLAS reads
) -> tuple[torch.Tensor, torch.Tensor]:  # q [M, K] float8_e4m3fn, scales [M, ceil(K / group)] float32
    m, k = x.shape
    groups = triton.cdiv(k, group)
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    if rows_minor:
        scales = torch.empty((groups, m), dtype=torch.float32, device=x.device).t()
    else:
        scales = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    if m:
        _quant_groups_kernel[(m, groups)](x, q, scales, k, groups, x.stride(0), scales.stride(0), scales.stride(1),
                                          GROUP=group, BLOCK=triton.next_power_of_2(group),
                                          RECIPROCAL=x.is_cuda and not triton_interpreted(),
                                          num_warps=1 if group <= 128 else 4)
    return q, scales


@triton.jit
def fp8_dot(a, w, NATIVE_FP8: tl.constexpr):  # float8 [BM, BK] x [BK, BN] -> float32 [BM, BN]
    """One block's float8 product: the tensor cores' (compiled), or float32 dots of the exactly upcast operands."""
    if NATIVE_FP8:
        return tl.dot(a, w)
    else:
        return tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")


@triton.jit
def _fp8_block_gemm_kernel(
    a_ptr,  # [M, K]: float8 (A_FP8) or the activations' 16/32-bit type; last dim contiguous
    as_ptr,  # [M, G_K] float32 activation group scales (A_FP8)
    w_ptr,  # [N, K] float8 e4m3fn, contiguous
    ws_ptr,  # [ceil(N / BN_SCALE), G_K] float32 weight block scales
    out_ptr,  # [M, N] contiguous
    bias_ptr,  # [N] (HAS_BIAS)
    M, N, K, G_K, stride_am,
    BN_SCALE: tl.constexpr,  # weight rows a scale block
    A_FP8: tl.constexpr,
    NATIVE_FP8: tl.constexpr,  # float8 tensor-core dots (compiled); else float32 dots of the upcast operands
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,  # BLOCK_K: a scale block's inputs
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :]  # [BM, BK]
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * K + offs_k[:, None]  # [BK, BN]
    ws_ptrs = ws_ptr + (offs_n // BN_SCALE) * G_K  # [BN]: each column's row of block scales
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, G_K):
        k_ok = offs_k < K - kb * BLOCK_K
        a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        w_s = tl.load(ws_ptrs + kb, mask=n_ok, other=0.0)  # [BN]
        if A_FP8:
            part = fp8_dot(a, w, NATIVE_FP8)
            a_s = tl.load(as_ptr + offs_m * G_K + kb, mask=m_ok, other=0.0)  # [BM]
            acc += part * (a_s[:, None] * w_s[None, :])
        else:
            if a.dtype == tl.float32:
                part = tl.dot(a, w.to(tl.float32), input_precision="ieee")
            else:
                part = tl.dot(a, w.to(a.dtype))
            acc += part * w_s[None, :]
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def usable(x: torch.Tensor, block: tuple[int, int], act_group: int | None) -> bool:
    """Whether the kernel takes this product: 16/32-bit rows, a power-of-two block depth of 16-256 inputs that the
    activation groups (if any) share, on CUDA (or under the interpreter, for tests)."""
    bk = block[1]
    return ((x.is_cuda or triton_interpreted()) and x.dim() == 2 and x.stride(-1) == 1
            and x.dtype in (torch.float16, torch.bfloat16, torch.float32)
            and 16 <= bk <= 256 and bk & (bk - 1) == 0 and act_group in (None, bk))


def _tiles(m: int, n: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages): narrow column tiles for few rows, so that enough programs
    stream the weight; square ones once the product is compute-bound."""
    if m <= 16:
        return 16, 32 if n <= 8192 else 64, 4, 4
    if m <= 64:
        return 32 if m <= 32 else 64, 64, 4, 3
    return 64 if m <= 128 else 128, 128, 8, 3


def fp8_block_linear(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K] float8 e4m3fn
    scale: torch.Tensor,  # [ceil(N / bn), ceil(K / bk)] float32
    block: tuple[int, int],  # (bn, bk)
    act_group: int | None,  # bk: activations quantized per token and group; None: kept in x's type
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N] in x's dtype
    m, k = x.shape
    n = weight.shape[0]
    bn, bk = block
    g_k = triton.cdiv(k, bk)
    if tuple(scale.shape) != (triton.cdiv(n, bn), g_k) or weight.shape[1] != k:
        raise ValueError(f"fp8 block product: weight {tuple(weight.shape)} with scales {tuple(scale.shape)} does not "
                         f"fit {k} inputs in blocks of {block}")
    if _cublas_takes(x, weight, block, act_group):
        return _cublas_block_linear(x, weight, scale, bias)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    if act_group is not None:
        a, a_s = quantize_groups(x, act_group)
    else:
        a, a_s = x, scale  # a_s unread
    block_m, block_n, warps, stages = _tiles(m, n)
    _fp8_block_gemm_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
        a, a_s, weight, scale.contiguous(), out, out if bias is None else bias, m, n, k, g_k, a.stride(0),
        BN_SCALE=bn, A_FP8=act_group is not None, NATIVE_FP8=x.is_cuda and not triton_interpreted(),
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=bk, num_warps=warps, num_stages=stages,
    )
    return out


# Past 64 rows (the kernel's narrow-tile range) cuBLAS's block-scaled float8 GEMM (CUDA 12.9 and later, on Hopper)
# keeps its tensor cores busier than the kernel above, which scales every block's sums in its main loop: on an H100
# at 96 rows qkv took 18.9 against 25.6 µs, at 64 the kernel was ahead on three Llama-3-8B shapes of four.
CUBLAS_MIN_ROWS = 65
_CUBLAS_PROBED: dict[int, bool] = {}  # device index -> whether its cuBLAS takes 1x128 by 128x128 scaled float8


def _cublas_takes(x: torch.Tensor, weight: torch.Tensor, block: tuple[int, int], act_group: int | None) -> bool:
    """Whether this product goes to cuBLAS: bf16 rows of at least ``CUBLAS_MIN_ROWS``, 128x128 blocks with
    activation groups of 128, whole blocks, a scale row a multiple of 4 blocks (cuBLAS's alignment), and a device
    whose cuBLAS answered the probe (taken once, outside CUDA-graph capture)."""
    n, k = weight.shape
    if (x.shape[0] < CUBLAS_MIN_ROWS or not x.is_cuda or triton_interpreted() or x.dtype != torch.bfloat16
            or block != (128, 128) or act_group != 128 or n % 128 or k % 512 or not hasattr(F, "scaled_mm")):
        return False
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    if index not in _CUBLAS_PROBED:
        if torch.cuda.is_current_stream_capturing():
            return False
        _CUBLAS_PROBED[index] = _cublas_agrees(x.device)
    return _CUBLAS_PROBED[index]


def _cublas_agrees(device: torch.device) -> bool:
    """Whether cuBLAS multiplies a block-scaled probe (rows, weight blocks and activation groups each with scales of
    their own) as the Triton kernel does, within bfloat16 rounding: False where it refuses the scaled modes (an
    older cuBLAS, another GPU) or reads the scales otherwise."""
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(CUBLAS_MIN_ROWS, 512, generator=g, device=device) * torch.rand(1, 512, generator=g, device=device)
    weight = (torch.randn(256, 512, generator=g, device=device) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(2, 4, generator=g, device=device) + 0.05
    x = x.bfloat16()
    try:
        got = _cublas_block_linear(x, weight, scale, None).float()
    except (RuntimeError, NotImplementedError):
        return False
    a, a_s = quantize_groups(x, 128)
    want = torch.empty(x.shape[0], 256, dtype=x.dtype, device=device)
    _fp8_block_gemm_kernel[(triton.cdiv(x.shape[0], 64), 2)](
        a, a_s, weight, scale, want, want, x.shape[0], 256, 512, 4, a.stride(0), BN_SCALE=128, A_FP8=True,
        NATIVE_FP8=True, HAS_BIAS=False, BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=2)
    return bool(((got - want.float()).abs().max() <= 2e-2 * want.float().abs().max()).item())


def _cublas_block_linear(
    x: torch.Tensor,  # [M, K] bfloat16
    weight: torch.Tensor,  # [N, K] float8 e4m3fn
    scale: torch.Tensor,  # [N / 128, K / 128] float32
    bias: torch.Tensor | None,  # [N]
) -> torch.Tensor:  # [M, N] bfloat16
    """The block-scaled product through cuBLAS: x quantized per token and 128 inputs by the same quantizer (its
    scales column-major, rows padded to a multiple of 4 as cuBLAS asks), the float8 sums scaled a block at a time."""
    m = x.shape[0]
    padded = F.pad(x, (0, 0, 0, -m % 4)) if m % 4 else x
    a, a_scale = quantize_groups(padded, 128, rows_minor=True)
    y = F.scaled_mm(a, weight.t(), a_scale, F.ScalingType.BlockWise1x128, scale.float().t(),
                    F.ScalingType.BlockWise128x128, output_dtype=torch.bfloat16)[:m]
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y
