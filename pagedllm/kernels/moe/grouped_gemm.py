"""Triton grouped GEMM over expert-aligned rows: each program multiplies ``BLOCK_M`` rows of one expert.

The rows come from ``align.moe_align_block_size``; a row's pair index ``p`` picks its input row
(``p // top_k`` of the tokens for gate/up, ``p`` itself for down) and its output row ``p``. Two
epilogues: ``GATED`` computes the gate and up columns of the same tile and writes ``silu(gate) * up``;
``ROUTED`` scales each row by its routing weight. Products accumulate in float32; results are rounded
where torch's reference rounds them (the projections, the activation), so float16/bfloat16 results stay
within a rounding of the per-expert loop.

Float8 experts (``W_SCALED``): the weight tiles load as float8 e4m3 and are upcast to the activation's
type in registers, so the weight read (what a decode step costs) halves; each output column's scale
(per expert and output row of the weight) multiplies the float32 sums in the epilogue.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,  # [rows, K]: tokens (gate/up) or pairs (down); last dim contiguous
    w_ptr,  # [E, N_w, K] (N_w = 2N when GATED); last dim contiguous
    out_ptr,  # [P, N] contiguous
    topk_weights_ptr,  # [P] float32
    w_scale_ptr,  # [E, N_w] float32 when W_SCALED
    sorted_ids_ptr,  # [max_blocks * BLOCK_M] int32
    expert_ids_ptr,  # [max_blocks] int32
    num_padded_ptr,  # [1] int32
    N,
    K,
    num_pairs,  # P: the padding sentinel
    a_row_div,  # top_k for gate/up (a token's row), 1 for down (a pair's row)
    max_blocks,
    stride_am,
    stride_we,
    stride_wn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    GATED: tl.constexpr,
    ROUTED: tl.constexpr,
    W_SCALED: tl.constexpr,
    IEEE: tl.constexpr,  # float32 products in full precision rather than TF32
):
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    # Programs in groups of GROUP_M row blocks sweep the columns together: neighbours share weight tiles.
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_m = min(max_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    pairs = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M]
    valid = pairs < num_pairs
    a_rows = (pairs // a_row_div).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]  # [BLOCK_K, BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if W_SCALED:
            w = w.to(a.dtype)
        if IEEE:
            acc = tl.dot(a, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
        if GATED:
            w_up = tl.load(w_ptrs + N * stride_wn, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if W_SCALED:
                w_up = w_up.to(a.dtype)
            if IEEE:
                acc_up = tl.dot(a, w_up, acc_up, input_precision="ieee")
            else:
                acc_up = tl.dot(a, w_up, acc_up)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    dtype = out_ptr.dtype.element_ty
    if W_SCALED:
        n_w = 2 * N if GATED else N
        scale_ptrs = w_scale_ptr + expert * n_w + offs_n
        acc = acc * tl.load(scale_ptrs, mask=n_ok, other=0.0)[None, :]
        if GATED:
            acc_up = acc_up * tl.load(scale_ptrs + N, mask=n_ok, other=0.0)[None, :]
    if GATED:
        gate = acc.to(dtype).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        result = act * acc_up.to(dtype).to(tl.float32)
    else:
        result = acc
    if ROUTED:
        weights = tl.load(topk_weights_ptr + pairs, mask=valid, other=0.0)
        result = result.to(dtype).to(tl.float32) * weights[:, None]
    out_ptrs = out_ptr + pairs[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(out_ptrs, result.to(dtype), mask=valid[:, None] & n_ok[None, :])


def grouped_gemm(
    a: torch.Tensor,  # [rows, K]
    w: torch.Tensor,  # [E, N (2N if gated), K]
    out: torch.Tensor,  # [P, N]
    topk_weights: torch.Tensor | None,  # [P] float32, with routed
    sorted_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_padded: torch.Tensor,
    a_row_div: int,
    config: dict[str, int],
    gated: bool,
    w_scale: torch.Tensor | None = None,  # [E, N (2N if gated)] float32 when w is float8
) -> None:
    n, k = out.shape[1], a.shape[1]
    if w.shape[1] != (2 * n if gated else n) or w.shape[2] != k:
        raise ValueError(f"expert weights of shape {tuple(w.shape)} do not fit input width {k} and output width {n}")
    block_m = config["BLOCK_M"]
    max_blocks = sorted_ids.numel() // block_m
    grid = (max_blocks * triton.cdiv(n, config["BLOCK_N"]),)
    routed = topk_weights is not None
    scaled = w_scale is not None
    if scaled and (w_scale.shape != w.shape[:2] or w_scale.dtype != torch.float32 or not w_scale.is_contiguous()):
        raise ValueError(f"expert weight scales must be contiguous float32 of shape {tuple(w.shape[:2])}; got "
                         f"{w_scale.dtype} {tuple(w_scale.shape)}")
    _grouped_gemm_kernel[grid](
        a, w, out, topk_weights if routed else out, w_scale if scaled else out, sorted_ids, expert_ids, num_padded,
        n, k, out.shape[0], a_row_div, max_blocks, a.stride(0), w.stride(0), w.stride(1),
        BLOCK_M=block_m, BLOCK_N=config["BLOCK_N"], BLOCK_K=config["BLOCK_K"], GROUP_M=config["GROUP_M"],
        GATED=gated, ROUTED=routed, W_SCALED=scaled, IEEE=a.dtype == torch.float32,
        num_warps=config["num_warps"], num_stages=config["num_stages"],
    )
