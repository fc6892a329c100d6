"""Torch unpacking and dequantization of the packed integer layouts (AWQ, GPTQ, compressed-tensors): the CPU path
of those methods and the oracle of any fused kernel.

Every layout packs ``32 // bits`` values into an int32, value ``i`` in bits ``[i * bits, (i + 1) * bits)``;
AWQ additionally interleaves the eight 4-bit columns of a word (``AWQ_REVERSE_ORDER``).
"""
from __future__ import annotations

import torch

# Logical column i of an AWQ word is stored in nibble AWQ_REVERSE_ORDER[i] (AutoAWQ's GEMM packing order
# [0, 2, 4, 6, 1, 3, 5, 7], inverted).
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The unsigned ``bits``-bit values of ``packed`` (int32), ``dim`` grown by ``32 // bits``; int32 result."""
    if 32 % bits:
        raise ValueError(f"bits {bits} do not divide a 32-bit word")
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    x = packed.movedim(dim, -1)
    vals = (x.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., W, per]
    vals = vals.reshape(*x.shape[:-1], x.shape[-1] * per)
    return vals.movedim(-1, dim)


def pack_int32(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Inverse of ``unpack_int32``: unsigned values along ``dim`` (a multiple of ``32 // bits``) into int32 words."""
    per = 32 // bits
    x = values.to(torch.int64).movedim(dim, -1)
    x = x.reshape(*x.shape[:-1], x.shape[-1] // per, per)
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=values.device)
    words = (x << shifts).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words)  # the same bits as a signed int32
    return words.to(torch.int32).movedim(-1, dim)


def awq_unpack(packed: torch.Tensor) -> torch.Tensor:  # [R, C / 8] int32 -> [R, C] in 0..15
    vals = unpack_int32(packed, 4, 1)
    order = torch.arange(vals.shape[1], device=packed.device).view(-1, 8)[:, list(AWQ_REVERSE_ORDER)].reshape(-1)
    return vals[:, order]


def awq_dequantize(
    qweight: torch.Tensor,  # [K, N / 8] int32
    qzeros: torch.Tensor,  # [K / g, N / 8] int32
    scales: torch.Tensor,  # [K / g, N]
    group_size: int,
) -> torch.Tensor:  # [N, K] float32
    q = awq_unpack(qweight)
    z = awq_unpack(qzeros).repeat_interleave(group_size, dim=0)
    s = scales.float().repeat_interleave(group_size, dim=0)
    return ((q - z).float() * s).t()


def gptq_dequantize(
    qweight: torch.Tensor,  # [K * bits / 32, N] int32, packed along the input
    qzeros: torch.Tensor,  # [G, N * bits / 32] int32, packed along the output
    scales: torch.Tensor,  # [G, N]
    g_idx: torch.Tensor,  # [K] group of each input channel
    bits: int,
    zero_offset: int,  # 1 for GPTQ's original format, which stores each zero point minus one; 0 for gptq_v2
) -> torch.Tensor:  # [N, K] float32
    q = unpack_int32(qweight, bits, 0)  # [K, N]
    z = unpack_int32(qzeros, bits, 1) + zero_offset  # [G, N]
    g = g_idx.long()
    return ((q - z[g]).float() * scales.float()[g]).t()


def ct_pack_dequantize(
    weight_packed: torch.Tensor,  # [N, K * bits / 32] int32, packed along the input
    weight_scale: torch.Tensor,  # [N, G]
    weight_zero_point: torch.Tensor | None,  # [N * bits / 32, G] int32, packed along the output; None: symmetric
    bits: int,
    group_size: int,  # input channels per scale column (K for one scale a row)
) -> torch.Tensor:  # [N, K] float32
    """compressed-tensors ``pack-quantized``: values stored offset by ``2**(bits-1)`` to be unsigned."""
    offset = 1 << (bits - 1)
    q = unpack_int32(weight_packed, bits, 1) - offset
    s = weight_scale.float().repeat_interleave(group_size, dim=1)
    if weight_zero_point is None:
        return q.float() * s
    z = (unpack_int32(weight_zero_point, bits, 0) - offset).repeat_interleave(group_size, dim=1)
    return (q - z).float() * s


def block_dequantize(
    weight: torch.Tensor,  # [N, K] float8
    scale: torch.Tensor,  # [ceil(N / bn), ceil(K / bk)]
    block: tuple[int, int],
) -> torch.Tensor:  # [N, K] float32
    n, k = weight.shape
    s = scale.float().repeat_interleave(block[0], dim=0)[:n].repeat_interleave(block[1], dim=1)[:, :k]
    return weight.float() * s
