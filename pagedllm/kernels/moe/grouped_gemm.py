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

Packed experts (``BITS`` 4 or 8: AWQ, GPTQ and compressed-tensors W4A16/W8A16 checkpoints): each expert's weight
is ``kernels/wna16.py``'s packed layout, int32 words [K / pack, N_w] with ``pack`` values along the input, and a
scale and zero point per group of inputs and output column ([G, N_w] an expert). A tile's words are read once,
their values shifted out in registers, and ``(q - z) * s`` rounded to the activation's type, as the per-expert
path's dequantized weight is, before the tensor-core product; the weight stays packed in memory. Groups
follow ``k // GROUP``, or a per-expert index of each input row (GPTQ act-order, rows in checkpoint order).

Int8 W8A8 experts (``A_INT8``, compressed-tensors ``int-quantized`` with symmetric weights): the input rows arrive
quantized to int8 with a scale each (``fused_moe._product_input``), the int8 tensor-core dots sum exactly in int32,
and the epilogue applies the row's scale then the output column's, as ``w8a8_linear`` does. Asymmetric per-token
activations (``A_ZP``) also carry a zero point per row: the epilogue first takes ``zero * sum(weight row)`` off the
sums (the weight rows' sums are kept at load), each product and difference rounded as torch rounds them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedllm.kernels.fp8_block import fp8_dot
from pagedllm.kernels.numerics import add_rn, exact_rounding, mul_rn
from pagedllm.kernels.launch import triton_interpreted
from pagedllm.kernels.wna16 import _PAIRS_DEQUANT_ASM, _pairs_group_tile, _unpack, row_group_scales
from pagedllm.kernels.wna16_gemv import PAIR_MAGIC, pairs_apply


@dataclass
class BlockFp8ExpertWeights:
    """One projection of a layer's block-wise float8 experts (DeepSeek/Qwen3-FP8 checkpoints), stacked."""

    weight: torch.Tensor  # [E, N_w, K] float8 e4m3fn
    scale: torch.Tensor  # [E, ceil(N_w / bn), ceil(K / bk)] float32
    block: tuple[int, int]  # (bn, bk)

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.weight.shape)


@dataclass
class Int8ExpertWeights:
    """One projection of a layer's W8A8 experts, stacked: symmetric int8 rows with a float32 scale each; with
    ``row_sums``, the activations are quantized asymmetrically (a zero point per token)."""

    weight: torch.Tensor  # [E, N_w, K] int8
    scale: torch.Tensor  # [E, N_w] float32
    row_sums: torch.Tensor | None = None  # [E, N_w] float32: each weight row's sum, for asymmetric activations

    @staticmethod
    def asymmetric(weight: torch.Tensor, scale: torch.Tensor) -> "Int8ExpertWeights":
        """Experts whose activations take a zero point per token: the weight rows' sums computed here, once."""
        return Int8ExpertWeights(weight, scale, weight.sum(dim=-1, dtype=torch.int32).float().contiguous())

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.weight.shape)


@dataclass
class PackedExpertWeights:
    """One projection of a layer's experts in the packed 4/8-bit layout (``kernels/wna16.py``'s, stacked)."""

    qweight: torch.Tensor  # [E, K / pack, N_w] int32
    scales: torch.Tensor  # [E, G, N_w] in the activation dtype
    zeros: torch.Tensor  # [E, G, N_w] float32
    g_idx: torch.Tensor | None  # [E, P, K] int32 group of each input row per projection (P = 2: gate, up), or None
    bits: int
    group_size: int  # inputs a group (ignored with g_idx)

    @property
    def shape(self) -> tuple[int, int, int]:
        """(E, N_w, K), as a stacked 16-bit weight's."""
        e, words, n_w = self.qweight.shape
        return e, n_w, words * (32 // self.bits)


@triton.jit
def _packed_tile(
    qw_ptr,  # this expert's [K / pack, N_w] int32 words
    s_ptr,  # this expert's [G, N_w] scales
    z_ptr,  # this expert's [G, N_w] zero points
    g_ptr,  # this projection's [K] group of each input row, with HAS_GIDX
    k0, K, N_W, offs_n, n_ok,
    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_GIDX: tl.constexpr, ROW_GROUPS: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
    PAIRS: tl.constexpr = False,  # (4-bit, 16-bit activations, scales in their dtype, no ROW_GROUPS) _pairs_tile
    PAIRS_ASM: tl.constexpr = "",
    MAGIC16: tl.constexpr = 0.0,
    EMULATE: tl.constexpr = False,
):  # -> [BLOCK_K, BLOCK_N] float32 (in the activation dtype with PAIRS): the dequantized weight of inputs k0..
    PACK: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    WORDS: tl.constexpr = BLOCK_K // PACK
    offs_w = k0 // PACK + tl.arange(0, WORDS)
    words = tl.load(qw_ptr + offs_w[:, None] * N_W + offs_n[None, :], mask=(offs_w * PACK < K)[:, None] & n_ok[None, :],
                    other=0)  # [WORDS, BN]
    if PAIRS:
        # Two values an instruction, the two-step path's bits (kernels/wna16.py); one group a tile.
        g0 = k0 // GROUP
        w = _pairs_group_tile(words, s_ptr + g0 * N_W, z_ptr + g0 * N_W, offs_n, n_ok, PAIRS_ASM, MAGIC16, BLOCK_K,
                              BLOCK_N, EMULATE)
    else:
        shifts = tl.arange(0, PACK) * BITS
        q = tl.reshape(_unpack(words[:, None, :], shifts[None, :, None], MASK), (BLOCK_K, BLOCK_N))
        if ROW_GROUPS:
            # Groups change inside the tile (act-order indices, or groups shorter than BLOCK_K): per-row gathers.
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < K
            s, z = row_group_scales(s_ptr, z_ptr, g_ptr, offs_k, k_ok, offs_n, n_ok, N_W, GROUP, HAS_GIDX)
            w = (q - z) * s
        else:
            # The tile lies in one group: one row of scales and zero points (rows past K meet zero activations).
            g0 = k0 // GROUP
            s1 = tl.load(s_ptr + g0 * N_W + offs_n, mask=n_ok, other=0.0).to(tl.float32)
            z1 = tl.load(z_ptr + g0 * N_W + offs_n, mask=n_ok, other=0.0).to(tl.float32)
            w = (q - z1[None, :]) * s1[None, :]
    return w


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,  # [rows, K]: tokens (gate/up) or pairs (down); last dim contiguous
    w_ptr,  # [E, N_w, K] (N_w = 2N when GATED), last dim contiguous; packed (BITS): [E, K / pack, N_w] int32
    out_ptr,  # [P, N] contiguous
    topk_weights_ptr,  # [P] float32
    w_scale_ptr,  # [E, N_w] float32 when W_SCALED; packed: [E, G, N_w] group scales
    w_zero_ptr,  # packed: [E, G, N_w] float32 zero points; A_ZP: [rows] float32 zero points of the int8 rows
    g_idx_ptr,  # packed with HAS_GIDX: [E, P, K] int32 (P = 2 when GATED: the gate's rows, then the up's);
    # A_ZP: [E, N_w] float32 sums of the weight rows
    a_scale_ptr,  # W_BLOCK: [rows, ceil(K / BLOCK_K)] float32 scales of the float8 activation groups; A_INT8: [rows]
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
    stride_se,  # packed: an expert's scales and zero points (G * N_w)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    GATED: tl.constexpr,
    ROUTED: tl.constexpr,
    W_SCALED: tl.constexpr,
    IEEE: tl.constexpr,  # float32 products in full precision rather than TF32
    BITS: tl.constexpr = 0,  # 4 or 8: packed experts; 0: 16/32-bit or float8 weights
    GROUP: tl.constexpr = 1,
    HAS_GIDX: tl.constexpr = False,
    ROW_GROUPS: tl.constexpr = False,
    W_BLOCK: tl.constexpr = False,  # block-wise float8 experts: float8 activations, a scale a weight block
    BN_SCALE: tl.constexpr = 1,  # W_BLOCK: weight rows a scale block (BLOCK_K inputs deep)
    NATIVE_FP8: tl.constexpr = False,
    A_INT8: tl.constexpr = False,  # int8 rows and weights, int32 sums; W_SCALED holds the weight row scales
    A_ZP: tl.constexpr = False,  # A_INT8 rows quantized with a zero point each
    EXACT: tl.constexpr = False,  # A_ZP: round each epilogue product and difference (numerics.py)
    PAIRS: tl.constexpr = False,  # packed 4-bit experts dequantized two values an instruction (_packed_tile)
    PAIRS_ASM: tl.constexpr = "",
    MAGIC16: tl.constexpr = 0.0,
    EMULATE: tl.constexpr = False,  # (PAIRS) the interpreter: the PTX's arithmetic as Triton ops
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
    if BITS:
        n_w = 2 * N if GATED else N
        qw_e = w_ptr + expert * stride_we
        s_e = w_scale_ptr + expert * stride_se
        z_e = w_zero_ptr + expert * stride_se
        g_e = g_idx_ptr + expert * (2 * K if GATED else K)
    if W_BLOCK:
        g_k = tl.cdiv(K, BLOCK_K)
        ws_e = w_scale_ptr + expert * stride_se
    if A_INT8:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        if W_BLOCK:
            # A block's float8 dot, scaled by each row's activation group scale and each column's block scale.
            kb = k0 // BLOCK_K
            a_s = tl.load(a_scale_ptr + a_rows * g_k + kb, mask=valid, other=0.0)[:, None]  # [BM, 1]
            w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            w_s = tl.load(ws_e + (offs_n // BN_SCALE) * g_k + kb, mask=n_ok, other=0.0)
            acc += fp8_dot(a, w, NATIVE_FP8) * (a_s * w_s[None, :])
            if GATED:
                w_up = tl.load(w_ptrs + N * stride_wn, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
                ws_up = tl.load(ws_e + ((offs_n + N) // BN_SCALE) * g_k + kb, mask=n_ok, other=0.0)
                acc_up += fp8_dot(a, w_up, NATIVE_FP8) * (a_s * ws_up[None, :])
        else:
            if BITS:
                w = _packed_tile(qw_e, s_e, z_e, g_e, k0, K, n_w, offs_n, n_ok, BITS, GROUP, HAS_GIDX, ROW_GROUPS,
                                 BLOCK_K, BLOCK_N, PAIRS, PAIRS_ASM, MAGIC16, EMULATE).to(a.dtype)
            else:
                w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if W_SCALED:
                w = w.to(a.dtype)
            if A_INT8:
                acc = tl.dot(a, w, acc, out_dtype=tl.int32)
            elif IEEE:
                acc = tl.dot(a, w, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, w, acc)
            if GATED:
                if BITS:
                    w_up = _packed_tile(qw_e, s_e, z_e, g_e + K, k0, K, n_w, offs_n + N, n_ok, BITS, GROUP, HAS_GIDX,
                                        ROW_GROUPS, BLOCK_K, BLOCK_N, PAIRS, PAIRS_ASM, MAGIC16, EMULATE).to(a.dtype)
                else:
                    w_up = tl.load(w_ptrs + N * stride_wn, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
                if W_SCALED:
                    w_up = w_up.to(a.dtype)
                if A_INT8:
                    acc_up = tl.dot(a, w_up, acc_up, out_dtype=tl.int32)
                elif IEEE:
                    acc_up = tl.dot(a, w_up, acc_up, input_precision="ieee")
                else:
                    acc_up = tl.dot(a, w_up, acc_up)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    dtype = out_ptr.dtype.element_ty
    if A_INT8:
        # The exact int32 sums times the row's scale, then the column's (below): w8a8_linear's order of products.
        row_s = tl.load(a_scale_ptr + a_rows, mask=valid, other=0.0)[:, None]
        if A_ZP:
            # sum((q - z) * w) = sum(q * w) - z * sum(w), in float32 as w8a8_linear takes it.
            n_w = 2 * N if GATED else N
            zp = tl.load(w_zero_ptr + a_rows, mask=valid, other=0.0)[:, None]
            sums_ptrs = g_idx_ptr + expert * n_w + offs_n
            acc = add_rn(acc.to(tl.float32), -mul_rn(zp, tl.load(sums_ptrs, mask=n_ok, other=0.0)[None, :], EXACT),
                         EXACT)
            if GATED:
                acc_up = add_rn(acc_up.to(tl.float32),
                                -mul_rn(zp, tl.load(sums_ptrs + N, mask=n_ok, other=0.0)[None, :], EXACT), EXACT)
        acc = mul_rn(acc.to(tl.float32), row_s, EXACT)
        acc_up = mul_rn(acc_up.to(tl.float32), row_s, EXACT)
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
    w: torch.Tensor | PackedExpertWeights | BlockFp8ExpertWeights | Int8ExpertWeights,  # [E, N (2N if gated), K]
    out: torch.Tensor,  # [P, N]
    topk_weights: torch.Tensor | None,  # [P] float32, with routed
    sorted_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_padded: torch.Tensor,
    a_row_div: int,
    config: dict[str, int],
    gated: bool,
    w_scale: torch.Tensor | None = None,  # [E, N (2N if gated)] float32 when w is float8
    a_scale: torch.Tensor | None = None,  # [rows, ceil(K / bk)] float32: a's float8 group scales (block experts);
    # [rows, 1] float32: a's int8 row scales (int8 experts)
    a_zero: torch.Tensor | None = None,  # [rows, 1] float32: a's int8 row zero points (asymmetric int8 experts)
    pairs: bool | None = None,  # packed 4-bit experts dequantized two values an instruction; None: where it runs
) -> None:
    n, k = out.shape[1], a.shape[1]
    if w.shape[1] != (2 * n if gated else n) or w.shape[2] != k:
        raise ValueError(f"expert weights of shape {tuple(w.shape)} do not fit input width {k} and output width {n}")
    block_m = config["BLOCK_M"]
    max_blocks = sorted_ids.numel() // block_m
    grid = (max_blocks * triton.cdiv(n, config["BLOCK_N"]),)
    routed = topk_weights is not None
    if isinstance(w, BlockFp8ExpertWeights):
        _block_launch(a, a_scale, w, out, topk_weights, sorted_ids, expert_ids, num_padded, a_row_div, config, gated,
                      grid, max_blocks)
        return
    if isinstance(w, Int8ExpertWeights):
        _int8_launch(a, a_scale, a_zero, w, out, topk_weights, sorted_ids, expert_ids, num_padded, a_row_div, config,
                     gated, grid, max_blocks)
        return
    if isinstance(w, PackedExpertWeights):
        _packed_launch(a, w, out, topk_weights, sorted_ids, expert_ids, num_padded, a_row_div, config, gated, grid,
                       max_blocks, pairs)
        return
    scaled = w_scale is not None
    if scaled and (w_scale.shape != w.shape[:2] or w_scale.dtype != torch.float32 or not w_scale.is_contiguous()):
        raise ValueError(f"expert weight scales must be contiguous float32 of shape {tuple(w.shape[:2])}; got "
                         f"{w_scale.dtype} {tuple(w_scale.shape)}")
    _grouped_gemm_kernel[grid](
        a, w, out, topk_weights if routed else out, w_scale if scaled else out, out, out, out, sorted_ids, expert_ids,
        num_padded, n, k, out.shape[0], a_row_div, max_blocks, a.stride(0), w.stride(0), w.stride(1), 0,
        BLOCK_M=block_m, BLOCK_N=config["BLOCK_N"], BLOCK_K=config["BLOCK_K"], GROUP_M=config["GROUP_M"],
        GATED=gated, ROUTED=routed, W_SCALED=scaled, IEEE=a.dtype == torch.float32,
        num_warps=config["num_warps"], num_stages=config["num_stages"],
    )


def _packed_launch(a, w: PackedExpertWeights, out, topk_weights, sorted_ids, expert_ids, num_padded, a_row_div,
                   config, gated, grid, max_blocks, pairs: bool | None) -> None:
    e, n_w, k = w.shape
    groups = w.scales.shape[1]
    if w.scales.shape != (e, groups, n_w) or w.zeros.shape != w.scales.shape:
        raise ValueError(f"packed expert scales {tuple(w.scales.shape)} and zero points {tuple(w.zeros.shape)} must "
                         f"both be ({e}, groups, {n_w})")
    if w.g_idx is not None and tuple(w.g_idx.shape) != (e, 2 if gated else 1, k):
        raise ValueError(f"packed expert group indices {tuple(w.g_idx.shape)} must be ({e}, {2 if gated else 1}, {k})")
    pack = 32 // w.bits
    block_k = max(config["BLOCK_K"], pack)
    if w.g_idx is None:
        # Tiles no deeper than a group take one row of scales a step; per-row gathers cost shared memory.
        while block_k > max(16, pack) and w.group_size % block_k:
            block_k //= 2
    row_groups = w.g_idx is not None or w.group_size % block_k != 0
    # Per-row scale and zero-point gathers are staged like the weight: two stages keep them within shared memory.
    stages = min(config["num_stages"], 2) if row_groups else config["num_stages"]
    if pairs is None:
        pairs = pairs_apply(a, w.bits)
    pairs = pairs and w.bits == 4 and a.dtype in PAIR_MAGIC and not row_groups and w.scales.dtype == a.dtype
    _grouped_gemm_kernel[grid](
        a, w.qweight, out, topk_weights if topk_weights is not None else out, w.scales, w.zeros,
        w.g_idx if w.g_idx is not None else out, out, sorted_ids, expert_ids, num_padded, out.shape[1], k, out.shape[0],
        a_row_div, max_blocks, a.stride(0), w.qweight.stride(0), 0, w.scales.stride(0),
        BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"], BLOCK_K=block_k, GROUP_M=config["GROUP_M"],
        GATED=gated, ROUTED=topk_weights is not None, W_SCALED=False, IEEE=a.dtype == torch.float32,
        BITS=w.bits, GROUP=w.group_size, HAS_GIDX=w.g_idx is not None, ROW_GROUPS=row_groups,
        PAIRS=pairs, PAIRS_ASM=_PAIRS_DEQUANT_ASM.get(a.dtype, "") if pairs else "",
        MAGIC16=PAIR_MAGIC.get(a.dtype, 0.0) if pairs else 0.0, EMULATE=pairs and triton_interpreted(),
        num_warps=config["num_warps"], num_stages=stages,
    )


def _block_launch(a, a_scale, w: BlockFp8ExpertWeights, out, topk_weights, sorted_ids, expert_ids, num_padded,
                  a_row_div, config, gated, grid, max_blocks) -> None:
    from pagedllm.kernels.launch import triton_interpreted

    e, n_w, k = w.shape
    bn, bk = w.block
    if a.dtype != torch.float8_e4m3fn or a_scale is None or tuple(a_scale.shape) != (a.shape[0], triton.cdiv(k, bk)):
        raise ValueError(f"block-float8 experts take float8 activations with [rows, {triton.cdiv(k, bk)}] group scales")
    if tuple(w.scale.shape) != (e, triton.cdiv(n_w, bn), triton.cdiv(k, bk)) or (gated and (n_w // 2) % bn):
        raise ValueError(f"block-float8 expert scales {tuple(w.scale.shape)} do not fit weights {tuple(w.shape)} in "
                         f"blocks of {w.block} (a gated projection's halves must each be whole blocks)")
    _grouped_gemm_kernel[grid](
        a, w.weight, out, topk_weights if topk_weights is not None else out, w.scale, out, out, a_scale, sorted_ids,
        expert_ids, num_padded, out.shape[1], k, out.shape[0], a_row_div, max_blocks, a.stride(0),
        w.weight.stride(0), w.weight.stride(1), w.scale.stride(0),
        BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"], BLOCK_K=bk, GROUP_M=config["GROUP_M"],
        GATED=gated, ROUTED=topk_weights is not None, W_SCALED=False, IEEE=False,
        W_BLOCK=True, BN_SCALE=bn, NATIVE_FP8=a.is_cuda and not triton_interpreted(),
        num_warps=config["num_warps"], num_stages=config["num_stages"],
    )


def _int8_launch(a, a_scale, a_zero, w: Int8ExpertWeights, out, topk_weights, sorted_ids, expert_ids, num_padded,
                 a_row_div, config, gated, grid, max_blocks) -> None:
    e, n_w, k = w.shape
    if a.dtype != torch.int8 or a_scale is None or a_scale.numel() != a.shape[0] or a_scale.dtype != torch.float32:
        raise ValueError(f"int8 experts take int8 rows with a float32 scale each; got {a.dtype} rows and scales "
                         f"{None if a_scale is None else (a_scale.dtype, tuple(a_scale.shape))}")
    if w.weight.dtype != torch.int8 or tuple(w.scale.shape) != (e, n_w) or w.scale.dtype != torch.float32:
        raise ValueError(f"int8 expert scales must be float32 of shape {(e, n_w)}; got {w.scale.dtype} "
                         f"{tuple(w.scale.shape)}")
    asym = w.row_sums is not None
    if asym != (a_zero is not None) or (asym and (a_zero.numel() != a.shape[0] or tuple(w.row_sums.shape) != (e, n_w))):
        raise ValueError(f"int8 experts with weight row sums take rows with a zero point each, and only those; got "
                         f"row sums {None if w.row_sums is None else tuple(w.row_sums.shape)} and zero points "
                         f"{None if a_zero is None else tuple(a_zero.shape)} for {a.shape[0]} rows")
    _grouped_gemm_kernel[grid](
        a, w.weight, out, topk_weights if topk_weights is not None else out, w.scale,
        a_zero.float().contiguous() if asym else out, w.row_sums if asym else out, a_scale.contiguous(),
        sorted_ids, expert_ids, num_padded, out.shape[1], k, out.shape[0], a_row_div, max_blocks, a.stride(0),
        w.weight.stride(0), w.weight.stride(1), 0,
        BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"], BLOCK_K=max(config["BLOCK_K"], 32),  # int8 dots: K >= 32
        GROUP_M=config["GROUP_M"], GATED=gated, ROUTED=topk_weights is not None, W_SCALED=True, IEEE=False,
        A_INT8=True, A_ZP=asym, EXACT=asym and exact_rounding(a), num_warps=config["num_warps"],
        num_stages=config["num_stages"],
    )
