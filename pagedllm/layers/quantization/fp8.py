"""Float8 (e4m3) linears: one scale per weight row, one per activation row (token).

``--quantization fp8`` takes a 16- or 32-bit checkpoint, loads it as usual, then rounds every decoder
linear's weight to float8 with a float32 scale per output row (the row's largest magnitude over 448);
a float8 checkpoint loads into the same layout as stored (``serialized``). A product runs one of three ways:
- CUDA with float8 tensor cores (compute capability >= 8.9), up to 16 tokens in a half type: the GEMV
  (one token) or the skinny GEMM reads the float8 weight and scales each output row; the activation stays
  in 16 bits (a few decode tokens are a weight read, and this halves it).
- the same GPUs, more tokens: each activation row is quantized the same way (one Triton launch) and
  ``torch._scaled_mm`` multiplies on the float8 tensor cores, applying both scales to the float32 sums
  (cuBLAS's row-wise scaling). Where a norm or gated activation kernel feeds the linear, that kernel
  quantizes its own output instead (``quantize_output``, set by ``fused_rows.flag_producers``): ``QuantizedRows``.
- anywhere else (the CPU, older GPUs, float32 models): ``fp8_linear_ref``, the same quantization and
  the same scaled sum in float32, which is also the oracle of the fast paths.
The embedding and the LM head stay in the model's dtype, as in vLLM.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from pagedllm.kernels.fp8_quant import FP8_MAX, MIN_SCALE
from pagedllm.kernels.row_quant import QuantizedRows
from pagedllm.layers.linear import LinearMethodBase, UnquantizedLinearMethod

FP8_DTYPE = torch.float8_e4m3fn
# torch._scaled_mm's shape rule: both dimensions of the float8 weight must be multiples of 16.
_MM_ALIGN = 16


def quantize_rows_ref(
    x: torch.Tensor,  # [M, K]
) -> tuple[torch.Tensor, torch.Tensor]:  # q [M, K] float8_e4m3fn, scales [M, 1] float32
    """Each row over its own scale, rounded to nearest float8: the arithmetic of the Triton kernel."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    # A tensor divisor: CUDA torch divides by a Python scalar as a multiply by its reciprocal, which
    # would round differently from the kernel's (and the CPU's) true division.
    scales = (amax / torch.full_like(amax, FP8_MAX)).clamp(min=MIN_SCALE)
    return (xf / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scales


def fp8_linear_ref(
    x: torch.Tensor,  # [T, K]
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    weight_scale: torch.Tensor,  # [N] float32
    bias: torch.Tensor | None,  # [N]
) -> torch.Tensor:  # [T, N] in x's dtype
    """``x`` quantized per row, times the float8 weight, both scales applied to float32 sums."""
    q, scales = quantize_rows_ref(x)
    y = (q.float() @ weight.float().t()) * scales * weight_scale[None, :]
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


@functools.cache
def float8_products(device_index: int) -> bool:
    """Whether this CUDA device multiplies float8 on its tensor cores (compute capability >= 8.9: Ada, Hopper
    and later); older GPUs take the reference path."""
    return torch.cuda.get_device_capability(device_index) >= (8, 9)


# Products of 2 to this many tokens read the float8 weight in the skinny GEMM and keep the 16-bit
# activation, as the one-token GEMV does: a few tokens make a product a weight read, which float8 halves,
# while cuBLAS's float8 kernels are slower there than its 16-bit ones. Up to NARROW_MAX_ROWS tokens the
# products with no more outputs than inputs (attention's output and the MLP's down projection) still
# do; wider ones win on cuBLAS there (H200, ``linear_shapes.py --fp8 --fp8-sweep``).
WEIGHT_ONLY_MAX_ROWS = 32
NARROW_MAX_ROWS = 64


def weight_only_rows(m: int, shape: tuple[int, int] | None = None) -> bool:
    """Whether a float8 product over ``m`` rows keeps its activation in 16 bits (else it quantizes it);
    ``shape``: the weight's (outputs, inputs), where known."""
    if m == 1:
        return True
    return m <= WEIGHT_ONLY_MAX_ROWS or (m <= NARROW_MAX_ROWS and shape is not None and shape[0] <= shape[1])


def fuse_wanted(x: torch.Tensor, consumer: tuple[int, int] | None = None) -> bool:
    """Whether a producer flagged ``quantize_output`` should hand these rows over quantized: exactly when the
    float8 linear (whose weight's shape is ``consumer``) would quantize them itself (CUDA, a 16-bit type,
    more rows than its products that keep the 16-bit activation take)."""
    if not (x.is_cuda and x.dtype in (torch.float16, torch.bfloat16) and x.dim() == 2):
        return False
    return not weight_only_rows(x.shape[0], consumer) and float8_products(x.device.index or 0)


def quantizable(layer: nn.Module) -> bool:
    """A 2-D weight whose dimensions suit the float8 product."""
    w = getattr(layer, "weight", None)
    return w is not None and w.dim() == 2 and w.shape[0] % _MM_ALIGN == 0 and w.shape[1] % _MM_ALIGN == 0


def checkpoint_rows(layer: nn.Module, shard_id: int | str | None) -> int:
    """Output rows of one checkpoint tensor of ``layer`` (a q/k/v or gate/up shard, or the whole weight)."""
    if shard_id in ("q", "k", "v"):
        heads = layer.total_num_heads if shard_id == "q" else layer.total_num_kv_heads
        return heads * layer.head_size
    if isinstance(shard_id, int):
        return layer.output_sizes[shard_id]
    if hasattr(layer, "total_num_heads"):  # a fused q/k/v checkpoint tensor
        return (layer.total_num_heads + 2 * layer.total_num_kv_heads) * layer.head_size
    return sum(layer.output_sizes) if hasattr(layer, "output_sizes") else layer.output_size


def _load_weight_scale(layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    """A checkpoint's scales into ``weight_scale`` [N]: one a row ([n, 1] or [n]) as is, one a tensor
    repeated over that tensor's rows; the layer's own loader then places the shard."""
    loaded = loaded.float().reshape(-1)
    if loaded.numel() == 1:
        loaded = loaded.expand(checkpoint_rows(layer, shard_id)).contiguous()
    if shard_id is None:
        layer.weight_loader(param, loaded)
    else:
        layer.weight_loader(param, loaded, shard_id)


def _scaled_product(
    x: QuantizedRows,  # [T, K] float8 rows and their [T, 1] scales
    layer: nn.Module,
    bias: torch.Tensor | None,  # [N]
) -> torch.Tensor:  # [T, N] in x.dtype
    """Float8 rows times the layer's float8 weight on the tensor cores, both scales applied to the float32
    sums. ``weight.t()`` is the column-major [K, N] operand cuBLAS wants; scale_b its [1, N] row scales."""
    w = layer.weight
    y = torch._scaled_mm(x.q, w.t(), scale_a=x.scales, scale_b=layer.weight_scale.view(1, -1), out_dtype=x.dtype)
    return y if bias is None else y + bias


class Fp8LinearMethod(LinearMethodBase):
    """Multiplies in float8. ``serialized``: the checkpoint stores the float8 weight and its scales, which
    load into float8 parameters; otherwise the 16/32-bit weight is created, loaded, then quantized
    (``process_weights_after_loading``)."""

    def __init__(self, serialized: bool = False) -> None:
        self.serialized = serialized

    def create_weights(
        self, layer: nn.Module, input_size: int, output_size: int, bias: bool, params_dtype: torch.dtype
    ) -> None:
        UnquantizedLinearMethod().create_weights(layer, input_size, output_size, bias, params_dtype)
        if self.serialized:
            layer.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=FP8_DTYPE), requires_grad=False)
            layer.weight.weight_loader = layer.weight_loader
            layer.weight_scale = nn.Parameter(torch.empty(output_size, dtype=torch.float32), requires_grad=False)
            layer.weight_scale.weight_loader = functools.partial(_load_weight_scale, layer)

    @staticmethod
    def process_weights_after_loading(layer: nn.Module) -> None:
        """Replaces ``layer.weight`` [N, K] by its float8 rows and adds ``weight_scale`` [N] float32."""
        q, scales = quantize_rows_ref(layer.weight.data)
        layer.weight = nn.Parameter(q, requires_grad=False)
        layer.weight_scale = nn.Parameter(scales.reshape(-1).contiguous(), requires_grad=False)

    def quantized_input(self, layer: nn.Module) -> str | None:
        return "fp8" if quantizable(layer) else None

    def apply(self, layer: nn.Module, x: torch.Tensor | QuantizedRows, bias: torch.Tensor | None) -> torch.Tensor:
        w, w_scale = layer.weight, layer.weight_scale
        if isinstance(x, QuantizedRows):  # quantized by the norm or activation kernel that produced them (fuse_wanted)
            return _scaled_product(x, layer, bias)
        if x.is_cuda and x.dtype in (torch.float16, torch.bfloat16) and float8_products(x.device.index or 0):
            if weight_only_rows(x.shape[0], w.shape):
                from pagedllm.kernels import gemv, skinny_gemm

                if x.shape[0] == 1 and gemv.usable(x, w):
                    return gemv.gemv(x, w, bias, scale=w_scale)  # [1, N]
                if x.shape[0] > 1 and skinny_gemm.usable(x, w):
                    return skinny_gemm.skinny_gemm(x, w, bias, scale=w_scale)  # [T, N]
            from pagedllm.kernels import fp8_quant

            if x.shape[0] > 0 and fp8_quant.usable(x) and quantizable(layer):
                q, scales = fp8_quant.quantize_rows(x)  # [T, K] float8, [T, 1]
                return _scaled_product(QuantizedRows(q, scales, x.dtype), layer, bias)
        return fp8_linear_ref(x, w, w_scale, bias)
