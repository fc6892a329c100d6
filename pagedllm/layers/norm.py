"""RMSNorm with an optional fused residual add, in Llama's and Gemma's ``(1 + weight)`` flavours."""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.kernels.cpu import norm_rope


class RMSNorm(nn.Module):
    """``forward(x)`` returns the normalized ``x``; ``forward(x, residual)`` first adds the residual
    and returns ``(normalized, x + residual)`` so the decoder keeps one running residual stream.

    The statistics are computed in float32 and the result is cast back before the weight multiply,
    exactly as HF's LlamaRMSNorm, so half-precision outputs round the same way.

    ``quantize_output`` (set when a float8 or int8 linear alone consumes the output) makes the CUDA kernel hand
    the rows over as ``QuantizedRows`` wherever that linear would quantize them, quantized as it would.
    """

    quantize_output: str | None = None  # the consumer's kind of rows (row_quant.KINDS); fused_rows.flag_producers
    quantize_for: tuple[int, int] | None = None  # the consumer's weight shape (outputs, inputs)

    def __init__(self, hidden_size: int, eps: float = 1e-6, params_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        dtype = params_dtype or torch.get_default_dtype()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:  # [..., H] float32
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def _apply_weight(self, normed: torch.Tensor, input_dtype: torch.dtype) -> torch.Tensor:
        return self.weight * normed.to(input_dtype)

    def forward(
        self,
        x: torch.Tensor,  # [..., H]
        residual: torch.Tensor | None = None,  # [..., H]
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if x.is_cuda:
            # One fused Triton launch instead of ~9 small torch kernels; same op order (kernels/rmsnorm.py).
            from pagedllm.kernels import rmsnorm as kernel

            if kernel.usable(x, self.weight, residual):
                from pagedllm.layers.quantization.fused_rows import producer_quantization

                return kernel.rms_norm(x, self.weight, self.eps, residual, gemma=isinstance(self, GemmaRMSNorm),
                                       quantize=producer_quantization(self, x))
        elif type(self) in _CPU_KERNEL_CLASSES:
            # One C pass per row instead of ~9 torch ops (a decode step makes ~100 norm calls); exact
            # classes only, since a subclass may apply its weight otherwise. None: tensors it does not take.
            done = norm_rope.rms_norm_if_usable(x, self.weight, self.eps, residual, type(self) is GemmaRMSNorm)
            if done is not None:
                return done
        if residual is not None:
            x = x + residual
            residual = x
        out = self._apply_weight(self._normalize(x.float()), x.dtype)
        return out if residual is None else (out, residual)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"


class GemmaRMSNorm(RMSNorm):
    """Gemma's variant: the weight is stored as an offset from 1 and applied in float32 before the cast."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, params_dtype: torch.dtype | None = None) -> None:
        super().__init__(hidden_size, eps, params_dtype)
        self.weight.data.zero_()

    def _apply_weight(self, normed: torch.Tensor, input_dtype: torch.dtype) -> torch.Tensor:
        # In place: ``normed`` is _normalize's fresh float32 result, so this saves an [..., H] buffer.
        return normed.mul_(1.0 + self.weight.float()).to(input_dtype)


_CPU_KERNEL_CLASSES = (RMSNorm, GemmaRMSNorm)
