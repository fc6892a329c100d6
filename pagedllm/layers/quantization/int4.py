"""``--quantization int4``: 4-bit weight-only linears made at load from a 16/32-bit checkpoint, in the layout the
device's packed kernel reads.

On the CPU each weight row becomes llama.cpp's Q4_0 blocks (32 inputs, one float16 scale each, values
``round(w / d) + 8`` in [0, 15] with ``d`` the block's signed largest magnitude over -8), quantized by the
``gguf`` package and multiplied by the same compiled kernel that reads GGUF files (``kernels/cpu/gguf_gemm``),
through the GGUF linear method. On CUDA each group of 128 inputs of a row gets one scale (largest magnitude
over 7.5, symmetric, zero point 8) in the common W4A16 layout that the Triton kernel reads
(``wna16_layout.py``), as a symmetric GPTQ checkpoint without calibration would store it. A linear whose input
size is not a multiple of the block or group stays unquantized (logged).
"""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.layers.quantization import gguf as gguf_method
from pagedllm.layers.quantization import wna16_layout
from pagedllm.layers.quantization.base import QuantizedLinearMethod
from pagedllm.layers.quantization.unpack import pack_int32

Q4_0 = 2  # ggml's type id
Q4_0_BLOCK = 32
CUDA_GROUP = 128


def quantizable(layer: nn.Module) -> bool:
    """Whether the layer's input size splits into the device's blocks (32 on the CPU, 128 on CUDA)."""
    step = CUDA_GROUP if layer.weight.is_cuda else Q4_0_BLOCK
    return layer.weight.dim() == 2 and layer.weight.shape[1] % step == 0


def q4_0_rows(weight: torch.Tensor) -> torch.Tensor:  # [N, K] float -> [N, K / 32 * 18] uint8
    """Q4_0 blocks of every row, as llama.cpp's reference quantizer writes them (the ``gguf`` package's)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    rows = quantize(weight.detach().float().cpu().numpy(), GGMLQuantizationType.Q4_0)
    return torch.from_numpy(rows).contiguous()


def wna16_symmetric(weight: torch.Tensor, group: int = CUDA_GROUP) -> wna16_layout.WNA16Weights:
    """[N, K] float -> the W4A16 layout: ``q = clamp(round(w / s) + 8, 0, 15)``, ``s`` = group max |w| / 7.5."""
    n, k = weight.shape
    w = weight.detach().float().reshape(n, k // group, group)
    scale = w.abs().amax(dim=-1, keepdim=True) / 7.5
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = torch.clamp(torch.round(w / scale) + 8, 0, 15).to(torch.int32).reshape(n, k)
    scales = scale.squeeze(-1).t().to(weight.dtype).contiguous()  # [G, N]
    zeros = torch.full(scales.shape, 8.0, dtype=torch.float32, device=weight.device)
    return wna16_layout.WNA16Weights(pack_int32(q.t().contiguous(), 4, 0).contiguous(), scales, zeros, 4, group)


class Int4LinearMethod(QuantizedLinearMethod):
    """A linear quantized at load; ``quantize_loaded`` picks the layout by the weight's device."""

    def __init__(self, int8_activations: bool = False) -> None:
        self.cpu = gguf_method.GGUFLinearMethod(int8_activations)

    @staticmethod
    def quantize_loaded(layer: nn.Module) -> None:
        """Replaces ``layer.weight`` [N, K] by its 4-bit form (Q4_0 rows on the CPU, the W4A16 layout on CUDA)."""
        weight = layer.weight.data
        del layer.weight
        layer.packed_weight = None  # the float path's oneDNN copy: nothing to pack any more
        if weight.is_cuda:
            layer.wna16 = wna16_symmetric(weight)
            return
        layer.register_buffer("qweight_0", q4_0_rows(weight))
        layer.gguf_segments = [(0, weight.shape[0], Q4_0)]
        layer.gguf_dense_packed = [None]

    def dequantize(self, layer: nn.Module) -> torch.Tensor:  # [N, K] float32
        if hasattr(layer, "wna16"):
            return layer.wna16.dequantize()
        return self.cpu.dequantize(layer)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:  # [T, K] -> [T, N]
        if hasattr(layer, "wna16"):
            return wna16_layout.apply(layer, x, bias)
        if not gguf_method.packed_kernel_available(x.device):
            return super().apply(layer, x, bias)  # no compiler here: the dequantized float product
        return self.cpu.apply(layer, x, bias)
