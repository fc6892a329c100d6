"""Block-wise float8 linears (DeepSeek-V3 / Qwen3-FP8 style): float8 e4m3 weights with one float32 scale per block
of weights (128x128 in practice), activations quantized to float8 per token and group of input channels.

The scales are ``weight_scale_inv`` [ceil(N/bn), ceil(K/bk)] in vLLM's ``fp8`` layout (``weight_block_size``)
and ``weight_scale`` in compressed-tensors' ``block`` strategy; ``w = q * s[n // bn, k // bk]`` either way.
Both shard by whole blocks: a q/k/v or gate/up shard, or a rank's slice, must start and end on a block.
On CUDA the product is ``kernels/fp8_block.py``'s: float8 tensor-core dots a block deep, scaled per token group
and weight block, the weight never dequantized in memory. The torch path dequantizes both operands and
multiplies in float32: the CPU's path and the kernel's oracle.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.quantization.base import QuantizedLinearMethod
from pagedllm.layers.quantization.packed_params import PackedParam
from pagedllm.layers.quantization.unpack import block_dequantize

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max
_EPS = torch.finfo(torch.float32).eps


def quantize_groups_ref(
    x: torch.Tensor,  # [T, K]
    group: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # q [T, K] float8, scales [T, ceil(K / group)] float32
    """Each row's groups of ``group`` channels in float8, with a float32 scale a group (zero groups: eps)."""
    t, k = x.shape
    pad = (-k) % group
    xf = F.pad(x.float(), (0, pad)).view(t, -1, group)
    scale = xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX
    scale = torch.where(scale == 0, torch.full_like(scale, _EPS), scale)
    q = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(t, -1)[:, :k], scale.view(t, -1)


def fp8_group_quant_dequant(
    x: torch.Tensor,  # [T, K]
    group: int,
) -> torch.Tensor:  # [T, K] float32: each row's groups of ``group`` channels through float8 and back
    q, scale = quantize_groups_ref(x, group)
    return q.float() * scale.repeat_interleave(group, dim=1)[:, : x.shape[1]]


class Fp8BlockLinearMethod(QuantizedLinearMethod):
    experts_as_linears = True

    def __init__(self, block: tuple[int, int], scale_name: str, act_group: int | None) -> None:
        self.block = block
        self.scale_name = scale_name
        self.act_group = act_group  # None: activations stay in the model's dtype

    def packed_params(self, input_size: int, output_size: int, full_input_size: int) -> list[PackedParam]:
        bn, bk = self.block
        scales = (-(-output_size // bn), -(-input_size // bk))
        return [
            PackedParam("weight", (output_size, input_size), FP8_DTYPE, 0, 1, 1, 1),
            PackedParam(self.scale_name, scales, torch.float32, 0, bn, 1, bk),
        ]

    def dequantize(self, layer: nn.Module) -> torch.Tensor:  # [N, K]
        return block_dequantize(layer.weight, getattr(layer, self.scale_name), self.block)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.is_cuda:
            from pagedllm.kernels import fp8_block

            x2 = x.reshape(-1, x.shape[-1])
            if fp8_block.usable(x2, self.block, self.act_group):
                y = fp8_block.fp8_block_linear(x2, layer.weight, getattr(layer, self.scale_name), self.block,
                                               self.act_group, bias)
                return y.reshape(*x.shape[:-1], y.shape[-1])
        return self.torch_apply(layer, x, bias)

    def torch_apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        xd = x.float() if self.act_group is None else fp8_group_quant_dequant(x, self.act_group)
        return F.linear(xd, self.dequantize(layer), None if bias is None else bias.float()).to(x.dtype)
