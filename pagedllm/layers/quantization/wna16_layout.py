"""The common packed layout of 4/8-bit weight-only linears (AWQ, GPTQ, compressed-tensors pack-quantized), built
once at load from each checkpoint format, read by the Triton kernel (``kernels/wna16.py``) on CUDA.

Layout: ``qweight`` [K / pack, N] int32 with ``pack = 32 // bits`` unsigned values along the input (value
``i`` in bits ``[i * bits, (i + 1) * bits)``), ``scales`` [G, N] in the activation dtype and ``zeros`` [G, N]
float32, unsigned like the values; ``w[n, k] = (q[k, n] - zeros[g, n]) * scales[g, n]``. Symmetric formats
get their implicit midpoint ``2**(bits-1)`` as the zero point.

On the CPU the same weights are kept as rows (``WNA16Rows``): ``qrows`` [N, K / pack], the transpose of ``qweight``
(the values stay packed along the input), with float32 ``scales`` and ``zeros`` [N, G], for the compiled kernel
``kernels/cpu/wna16_gemm.py``.

GPTQ act-order: the input rows are permuted once at load so that rows of one group are adjacent
(``perm``, a stable sort of ``g_idx``), and each call gathers the activation columns by the same
permutation (``x[:, perm]``, a small copy next to the product). When every group then holds exactly
``group_size`` consecutive rows the kernel needs no group index; otherwise the sorted ``g_idx`` is kept
and read per row.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.quantization.unpack import awq_unpack, pack_int32, unpack_int32


@dataclass
class WNA16Weights:
    qweight: torch.Tensor  # [K / pack, N] int32
    scales: torch.Tensor  # [G, N]
    zeros: torch.Tensor  # [G, N] float32
    bits: int
    group_size: int  # inputs a group (K for one group); ignored for grouping when g_idx is set
    g_idx: torch.Tensor | None = None  # [K] int32 group of each (permuted) input row
    perm: torch.Tensor | None = None  # [K] int64: kernel row i is checkpoint input perm[i]

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    def dequantize(self) -> torch.Tensor:  # [N, K] float32, inputs in checkpoint order
        q = unpack_int32(self.qweight, self.bits, 0)  # [K, N]
        k = q.shape[0]
        g = self.g_idx.long() if self.g_idx is not None else torch.arange(k, device=q.device) // self.group_size
        w = ((q - self.zeros[g]).float() * self.scales.float()[g]).t()
        if self.perm is not None:
            w = torch.empty_like(w).index_copy_(1, self.perm, w)
        return w


@dataclass
class WNA16Rows:
    """The common layout as rows of W for the CPU kernel: every tensor the transpose of ``WNA16Weights``'."""

    qrows: torch.Tensor  # [N, K / pack] int32
    scales: torch.Tensor  # [N, G] float32
    zeros: torch.Tensor  # [N, G] float32
    bits: int
    group_size: int
    perm: torch.Tensor | None = None  # [K] int64: kernel input i is checkpoint input perm[i]

    @property
    def device(self) -> torch.device:
        return self.qrows.device

    def dequantize(self) -> torch.Tensor:  # [N, K] float32, inputs in checkpoint order
        from pagedllm.kernels.cpu.wna16_gemm import wna16_decode

        w = wna16_decode(self.qrows, self.scales, self.zeros, self.bits, self.group_size)
        if self.perm is not None:
            w = torch.empty_like(w).index_copy_(1, self.perm, w)
        return w


def _cpu_kernel_takes(w: WNA16Weights) -> bool:
    from pagedllm.kernels.cpu import wna16_gemm

    k = w.qweight.shape[0] * (32 // w.bits)
    return w.g_idx is None and wna16_gemm.supports(w.bits, w.group_size, k) and wna16_gemm.available()


def as_rows(w: WNA16Weights) -> WNA16Rows:
    return WNA16Rows(w.qweight.t().contiguous(), w.scales.t().float().contiguous(), w.zeros.t().float().contiguous(),
                     w.bits, w.group_size, w.perm)


def as_common(r: WNA16Rows) -> WNA16Weights:
    """``as_rows``' inverse (float32 scales): the layout the grouped MoE kernel stacks."""
    return WNA16Weights(r.qrows.t().contiguous(), r.scales.t().contiguous(), r.zeros.t().contiguous(), r.bits,
                        r.group_size, None, r.perm)


def _with_act_order(qweight: torch.Tensor, g_idx: torch.Tensor, bits: int, group_size: int, **kw) -> WNA16Weights:
    """Permutes the packed input rows by a stable sort of ``g_idx`` (qweight [K / pack, N])."""
    perm = torch.sort(g_idx.long(), stable=True).indices
    sorted_g = g_idx.long()[perm]
    k = sorted_g.numel()
    q = unpack_int32(qweight, bits, 0)[perm]
    contiguous = group_size > 0 and torch.equal(sorted_g, torch.arange(k, device=sorted_g.device) // group_size)
    return WNA16Weights(pack_int32(q, bits, 0).contiguous(), bits=bits, group_size=group_size if contiguous else k,
                        g_idx=None if contiguous else sorted_g.to(torch.int32).contiguous(), perm=perm, **kw)


def from_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> WNA16Weights:
    """AutoAWQ GEMM: qweight [K, N/8], qzeros [K/g, N/8] (interleaved along the outputs), scales [K/g, N]."""
    q = awq_unpack(qweight)  # [K, N]
    return WNA16Weights(pack_int32(q, 4, 0).contiguous(), scales.contiguous(), awq_unpack(qzeros).float(), 4,
                        group_size)


def from_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
              bits: int, group_size: int, zero_offset: int) -> WNA16Weights:
    """GPTQ: qweight [K*b/32, N], qzeros [G, N*b/32], scales [G, N]; g_idx [K] under act-order, else None."""
    k = qweight.shape[0] * (32 // bits)
    g = k if group_size == -1 else group_size
    zeros = (unpack_int32(qzeros, bits, 1) + zero_offset).float().contiguous()
    if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(k, device=g_idx.device) // g):
        return _with_act_order(qweight, g_idx, bits, g, scales=scales.contiguous(), zeros=zeros)
    return WNA16Weights(qweight.contiguous(), scales.contiguous(), zeros, bits, g)


def from_compressed_tensors(weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                            weight_zero_point: torch.Tensor | None, bits: int,
                            group_size: int | None) -> WNA16Weights:
    """pack-quantized: weight_packed [N, K*b/32], weight_scale [N, G], weight_zero_point [N*b/32, G] or None.
    Values and zero points are both stored offset by 2**(b-1), so their difference is that of the raw values."""
    k = weight_packed.shape[1] * (32 // bits)
    scales = weight_scale.t().contiguous()
    if weight_zero_point is None:
        zeros = torch.full(scales.shape, float(1 << (bits - 1)), dtype=torch.float32, device=scales.device)
    else:
        zeros = unpack_int32(weight_zero_point, bits, 0).t().float().contiguous()
    return WNA16Weights(weight_packed.t().contiguous(), scales, zeros, bits, k if group_size is None else group_size)


def in_checkpoint_order(w: WNA16Weights) -> tuple[torch.Tensor, torch.Tensor]:
    """``qweight`` [K / pack, N] with its input rows back in checkpoint order, and the group of each row [K] int32
    (undoing an act-order permutation, for kernels that read a group index per row instead)."""
    k = w.qweight.shape[0] * (32 // w.bits)
    g = w.g_idx.long() if w.g_idx is not None else torch.arange(k, device=w.qweight.device) // w.group_size
    if w.perm is None:
        return w.qweight, g.to(torch.int32)
    q = unpack_int32(w.qweight, w.bits, 0)  # [K, N], kernel row i = checkpoint input perm[i]
    q_ckpt, g_ckpt = torch.empty_like(q), torch.empty_like(g)
    q_ckpt[w.perm], g_ckpt[w.perm] = q, g
    return pack_int32(q_ckpt, w.bits, 0).contiguous(), g_ckpt.to(torch.int32)


def stack_experts(experts: list[list[WNA16Weights | WNA16Rows]]):
    """A layer's experts for the grouped MoE kernel: ``experts[e]`` is expert e's projections, concatenated along
    the outputs (gate then up, or down alone). Returns ``kernels.moe``'s ``PackedExpertWeights``."""
    from pagedllm.kernels.moe.grouped_gemm import PackedExpertWeights

    experts = [[as_common(w) if isinstance(w, WNA16Rows) else w for w in projections] for projections in experts]
    first = experts[0][0]
    for e, projections in enumerate(experts):
        for w in projections:
            if w.bits != first.bits or w.scales.shape[0] != first.scales.shape[0]:
                raise ValueError(f"expert {e}: {w.bits}-bit weights in {w.scales.shape[0]} groups; expert 0 has "
                                 f"{first.bits}-bit in {first.scales.shape[0]}: one layer's experts must share both")
    # Act-order experts keep their rows in checkpoint order with a group index per row (each projection has its
    # own permutation, which a kernel reading one activation tile for all of them cannot apply).
    act_order = any(w.perm is not None or w.g_idx is not None for ex in experts for w in ex)
    if not act_order and any(w.group_size != first.group_size for ex in experts for w in ex):
        raise ValueError("one layer's experts must share their group size")
    rows = [[in_checkpoint_order(w) for w in ex] for ex in experts]
    return PackedExpertWeights(
        qweight=torch.stack([torch.cat([q for q, _ in ex], dim=1) for ex in rows]).contiguous(),
        scales=torch.stack([torch.cat([w.scales for w in ex], dim=1) for ex in experts]).contiguous(),
        zeros=torch.stack([torch.cat([w.zeros for w in ex], dim=1) for ex in experts]).contiguous(),
        g_idx=torch.stack([torch.stack([g for _, g in ex]) for ex in rows]).contiguous() if act_order else None,
        bits=first.bits, group_size=first.group_size)


def use_kernel(layer: nn.Module) -> bool:
    """Whether a weight-only linear on this device takes a kernel: the Triton kernel on CUDA, the compiled one on
    the CPU (where it builds) rather than the torch path."""
    if any(p.is_cuda for p in layer.parameters(recurse=False)):
        return True
    from pagedllm.kernels.cpu import wna16_gemm

    return wna16_gemm.available()


def attach(layer: nn.Module, w: WNA16Weights, replaced: tuple[str, ...]) -> None:
    """Stores the common layout on ``layer`` (as rows on the CPU, where the CPU kernel reads it) and frees the
    checkpoint tensors it was built from."""
    for name in replaced:
        delattr(layer, name)
    layer.wna16 = as_rows(w) if not w.qweight.is_cuda and _cpu_kernel_takes(w) else w


def apply(layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:  # [..., K] -> [..., N]
    w: WNA16Weights | WNA16Rows = layer.wna16
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if isinstance(w, WNA16Weights) and not w.qweight.is_cuda:  # the CPU, where its kernel does not read this shape
        return torch_apply(w, x, bias)
    if w.perm is not None:
        x2 = x2.index_select(1, w.perm)
    if isinstance(w, WNA16Rows):
        from pagedllm.kernels.cpu.wna16_gemm import wna16_mm

        y = wna16_mm(x2.float(), w.qrows, w.scales, w.zeros, w.bits, w.group_size).to(x.dtype)
    else:
        from pagedllm.kernels.wna16 import wna16_matmul

        y = wna16_matmul(x2, w.qweight, w.scales, w.zeros, w.bits, w.group_size, w.g_idx)
    if bias is not None:
        y = y + bias
    return y.reshape(*shape[:-1], y.shape[-1])


def torch_apply(w: WNA16Weights, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The torch path over the common layout (dequantize, then a float matmul)."""
    return F.linear(x, w.dequantize().to(x.dtype), bias)
