"""Dequantizes GGUF (ggml) tensors with vectorized torch ops, on the device that holds the raw bytes.

Every block type is decoded to float32 with the same sequence of float operations as
``gguf.quants.dequantize`` (llama.cpp's reference decoders), so float32 results are bit-identical to
it and half-precision results are that value rounded once. Integer parts (quant codes, 6-bit scales)
are exact in float32, so only the order of the final multiplies and subtractions matters.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from math import prod

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

QK_K = 256  # elements in one k-quant super-block

# Decoded elements per step, bounding the f32 temporaries of a big tensor. On CPUs a few MiB keeps
# them in reused allocator memory (fresh large allocations page-fault and run several times slower);
# GPUs want big launches.
_CPU_CHUNK_ELEMENTS = 1 << 20
_GPU_CHUNK_ELEMENTS = 1 << 24

_Decoder = Callable[[torch.Tensor], torch.Tensor]  # (n_blocks, type_size) uint8 -> (n_blocks, block_size) f32


def _f16(b: torch.Tensor) -> torch.Tensor:
    """(n, 2) uint8 little-endian halves -> (n, 1) float32 (exact)."""
    return b.contiguous().view(torch.float16).to(torch.float32)


def _f32(q: torch.Tensor) -> torch.Tensor:
    return q.to(torch.float32)


def _shifts(values: Sequence[int], device: torch.device, ndim: int, axis: int) -> torch.Tensor:
    """A uint8 tensor of shift amounts laid along ``axis`` of an ``ndim``-dim broadcast shape."""
    shape = [1] * ndim
    shape[axis] = len(values)
    step = values[1] - values[0] if len(values) > 1 else 1
    if list(values) != list(range(values[0], values[0] + step * len(values), step)):
        raise ValueError(f"shift amounts {list(values)} are not an arithmetic progression")
    # arange fills on the device: no host-to-device copy, so a CUDA graph can capture the decoders.
    return torch.arange(values[0], values[0] + step * len(values), step, dtype=torch.uint8, device=device).reshape(shape)


def _nibbles(qs: torch.Tensor, groups: int) -> torch.Tensor:
    """(n, groups*w) packed bytes -> (n, groups, 2, w): per group the low nibbles, then the high ones."""
    n = qs.shape[0]
    q = qs.reshape(n, groups, 1, -1) >> _shifts([0, 4], qs.device, 4, 2)
    return q & 0x0F


def _bits(bytes_: torch.Tensor) -> torch.Tensor:
    """(n, w) bytes -> (n, 8, w) with [:, i, j] = bit i of byte j."""
    n = bytes_.shape[0]
    return (bytes_.reshape(n, 1, -1) >> _shifts(list(range(8)), bytes_.device, 3, 1)) & 1


def _dequant_f32(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.float32).clone()


def _dequant_f16(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.float16).to(torch.float32)


def _dequant_bf16(blocks: torch.Tensor) -> torch.Tensor:
    # bf16 -> f32 only appends zero mantissa bits, the same as ggml's ``<< 16``.
    return blocks.contiguous().view(torch.bfloat16).to(torch.float32)


def _dequant_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    # block: f16 d | int8 q[32];  x = q * d
    d = _f16(blocks[:, :2])
    q = _f32(blocks[:, 2:].contiguous().view(torch.int8))  # (n, 32)
    return q * d


def _dequant_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    # block: f16 d | 16 bytes of nibbles (element j low nibble, j+16 high nibble);  x = d * (q - 8)
    n = blocks.shape[0]
    d = _f16(blocks[:, :2])
    q = _nibbles(blocks[:, 2:], 1).reshape(n, 32)
    return d * (_f32(q) - 8.0)


def _dequant_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    # block: f16 d | f16 m | 16 bytes of nibbles;  x = d * q + m
    n = blocks.shape[0]
    d, m = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    q = _nibbles(blocks[:, 4:], 1).reshape(n, 32)
    return d * _f32(q) + m


def _q5_codes(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """5-bit codes (n, 32): the fifth bit of element j is bit j of the little-endian 32-bit ``qh``."""
    n = qs.shape[0]
    low = _nibbles(qs, 1).reshape(n, 32)
    high = _bits(qh).transpose(1, 2).reshape(n, 32)  # element 8*byte + bit
    return low | (high << 4)


def _dequant_q5_0(blocks: torch.Tensor) -> torch.Tensor:
    # block: f16 d | u32 qh | 16 bytes of nibbles;  x = d * (q - 16)
    d = _f16(blocks[:, :2])
    q = _q5_codes(blocks[:, 2:6], blocks[:, 6:])
    return d * (_f32(q) - 16.0)


def _dequant_q5_1(blocks: torch.Tensor) -> torch.Tensor:
    # block: f16 d | f16 m | u32 qh | 16 bytes of nibbles;  x = d * q + m
    d, m = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    q = _q5_codes(blocks[:, 4:8], blocks[:, 8:])
    return d * _f32(q) + m


def _dequant_q2_k(blocks: torch.Tensor) -> torch.Tensor:
    # super-block: u8 scales[16] (low nibble scale, high nibble min) | 2-bit q[64 bytes] | f16 d | f16 dmin
    n = blocks.shape[0]
    scales, qs = blocks[:, :16], blocks[:, 16:80]
    d, dmin = _f16(blocks[:, 80:82]), _f16(blocks[:, 82:84])
    dl = (d * _f32(scales & 0x0F)).reshape(n, 16, 1)
    ml = (dmin * _f32(scales >> 4)).reshape(n, 16, 1)
    # each 32-byte half holds four 2-bit planes; plane s of half h is elements 128h + 32s + j
    q = (qs.reshape(n, 2, 1, 32) >> _shifts([0, 2, 4, 6], qs.device, 4, 2)) & 3
    q = _f32(q.reshape(n, 16, 16))
    return (dl * q - ml).reshape(n, QK_K)


def _dequant_q3_k(blocks: torch.Tensor) -> torch.Tensor:
    # super-block: hmask[32] | 2-bit q[64] | 6-bit scales packed in 12 bytes | f16 d
    n = blocks.shape[0]
    hmask, qs, packed = blocks[:, :32], blocks[:, 32:96], blocks[:, 96:108]
    d = _f16(blocks[:, 108:110])
    # scale i: low 4 bits from nibble (i // 8) of byte i % 8, high 2 bits from bits 2*(i // 4) of byte 8 + i % 4
    low = (packed[:, :8].reshape(n, 1, 8) >> _shifts([0, 4], blocks.device, 3, 1)).reshape(n, 16) & 0x0F
    high = (packed[:, 8:].reshape(n, 1, 4) >> _shifts([0, 2, 4, 6], blocks.device, 3, 1)).reshape(n, 16) & 3
    scales = _f32(low | (high << 4)) - 32.0
    dl = (d * scales).reshape(n, 16, 1)
    ql = ((qs.reshape(n, 2, 1, 32) >> _shifts([0, 2, 4, 6], blocks.device, 4, 2)) & 3).reshape(n, 16, 16)
    # a set hmask bit means "no offset"; a clear one subtracts 4
    qh = (_bits(hmask).reshape(n, 16, 16)) ^ 1
    q = _f32(ql) - _f32(qh << 2)
    return (dl * q).reshape(n, QK_K)


def _k_scale_min(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K 12-byte packing of eight 6-bit scales and mins -> two (n, 8) uint8 tensors."""
    a, b, c = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = torch.cat([a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)], dim=-1)
    mn = torch.cat([b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)], dim=-1)
    return sc, mn


def _dequant_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    # super-block: f16 d | f16 dmin | 12 bytes scales/mins | 128 bytes of nibbles (8 sub-blocks of 32)
    n = blocks.shape[0]
    d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    sc, mn = _k_scale_min(blocks[:, 4:16])
    ds = (d * _f32(sc)).reshape(n, 8, 1)
    dm = (dmin * _f32(mn)).reshape(n, 8, 1)
    q = _f32(_nibbles(blocks[:, 16:], 4).reshape(n, 8, 32))
    return (ds * q - dm).reshape(n, QK_K)


def _dequant_q5_k(blocks: torch.Tensor) -> torch.Tensor:
    # super-block: f16 d | f16 dmin | 12 bytes scales/mins | qh[32] | 128 bytes of nibbles
    n = blocks.shape[0]
    d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    sc, mn = _k_scale_min(blocks[:, 4:16])
    ds = (d * _f32(sc)).reshape(n, 8, 1)
    dm = (dmin * _f32(mn)).reshape(n, 8, 1)
    low = _nibbles(blocks[:, 48:], 4).reshape(n, 8, 32)
    high = _bits(blocks[:, 16:48])  # (n, 8, 32): sub-block i takes bit i of each qh byte
    q = _f32(low | (high << 4))
    return (ds * q - dm).reshape(n, QK_K)


def _dequant_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    # super-block: ql[128] low nibbles | qh[64] 2-bit highs | int8 scales[16] | f16 d;  x = d * scale * (q - 32)
    n = blocks.shape[0]
    ql, qh = blocks[:, :128], blocks[:, 128:192]
    scales = _f32(blocks[:, 192:208].contiguous().view(torch.int8))
    d = _f16(blocks[:, 208:210])
    ds = (d * scales).reshape(n, 16, 1)
    low = _nibbles(ql, 2).reshape(n, 8, 32)
    high = ((qh.reshape(n, 2, 1, 32) >> _shifts([0, 2, 4, 6], blocks.device, 4, 2)) & 3).reshape(n, 8, 32)
    q = (_f32(low | (high << 4)) - 32.0).reshape(n, 16, 16)
    return (ds * q).reshape(n, QK_K)


_T = GGMLQuantizationType
_DECODERS: dict[int, _Decoder] = {
    _T.F32: _dequant_f32,
    _T.F16: _dequant_f16,
    _T.BF16: _dequant_bf16,
    _T.Q8_0: _dequant_q8_0,
    _T.Q4_0: _dequant_q4_0,
    _T.Q4_1: _dequant_q4_1,
    _T.Q5_0: _dequant_q5_0,
    _T.Q5_1: _dequant_q5_1,
    _T.Q2_K: _dequant_q2_k,
    _T.Q3_K: _dequant_q3_k,
    _T.Q4_K: _dequant_q4_k,
    _T.Q5_K: _dequant_q5_k,
    _T.Q6_K: _dequant_q6_k,
}

SUPPORTED_TYPES: frozenset[GGMLQuantizationType] = frozenset(GGMLQuantizationType(t) for t in _DECODERS)


def type_name(qtype: int) -> str:
    try:
        return GGMLQuantizationType(int(qtype)).name
    except ValueError:
        return f"ggml type {int(qtype)}"


def block_layout(qtype: int) -> tuple[int, int]:
    """(elements per block, bytes per block) of a ggml type."""
    return GGML_QUANT_SIZES[GGMLQuantizationType(int(qtype))]


def dequantize(
    raw: torch.Tensor,
    qtype: int,
    shape: Sequence[int],
    dtype: torch.dtype = torch.float32,
    chunk_elements: int | None = None,
) -> torch.Tensor:
    """Decode one GGUF tensor to ``dtype`` on ``raw.device``.

    ``raw``: the tensor's bytes as the file stores them (any shape; uint8, or the float dtype
    ``gguf.GGUFReader`` gives F32/F16 tensors), contiguous rows of blocks. ``shape``: the logical
    shape in torch order (rows..., cols), i.e. GGUF's ``ne`` reversed. Returns a new tensor of
    ``shape`` that never aliases ``raw``.
    """
    qtype = int(qtype)
    decoder = _DECODERS.get(qtype)
    if decoder is None:
        supported = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
        raise NotImplementedError(f"cannot dequantize {type_name(qtype)}; supported: {supported}")
    block_size, type_size = block_layout(qtype)
    numel = prod(shape)
    if numel % block_size:
        raise ValueError(f"{type_name(qtype)} tensor of shape {tuple(shape)} is not a whole number of blocks")
    n_blocks = numel // block_size
    data = raw.contiguous().reshape(-1).view(torch.uint8)
    if data.numel() != n_blocks * type_size:
        raise ValueError(
            f"{type_name(qtype)} tensor of shape {tuple(shape)} needs {n_blocks * type_size} bytes, got {data.numel()}"
        )
    blocks = data.reshape(n_blocks, type_size)  # (n_blocks, type_size) uint8

    if chunk_elements is None:
        chunk_elements = _CPU_CHUNK_ELEMENTS if data.device.type == "cpu" else _GPU_CHUNK_ELEMENTS
    step = max(1, chunk_elements // block_size)
    if n_blocks <= step:
        return decoder(blocks).to(dtype).reshape(shape)
    out = torch.empty(n_blocks, block_size, dtype=dtype, device=data.device)  # (n_blocks, block_size)
    for start in range(0, n_blocks, step):
        out[start : start + step] = decoder(blocks[start : start + step])
    return out.reshape(shape)
