"""INT8 W8A8 linears: int8 weights with a scale per output row, activations quantized per token at run time.

Read from compressed-tensors ``int-quantized`` checkpoints (``weight`` int8 [N, K], ``weight_scale`` [N, 1],
``weight_zero_point`` [N, 1] for asymmetric weights) and made at load by ``--quantization int8``, which
quantizes each row of a 16/32-bit weight symmetrically as compressed-tensors does (largest magnitude over
127.5, rounded to nearest, clamped to [-128, 127]), so both give the same weights. Activations follow the
same arithmetic per token, symmetric or asymmetric (a zero point per token). The product multiplies the
int8 operands exactly in int32 (``torch._int_mm``) and applies the scales, and the activations' zero points
through each row's weight sum, to that (on the CPU through ``kernels/cpu/int8_gemm.py``: torch's int8 product took
10-37x its time, and symmetric rows quantize and scale there too); asymmetric weights take the dequantized float path instead. On CUDA
a product of at most 16 rows (decode) takes ``kernels/int8_gemm.py`` (int32 product and epilogue in one launch,
one symmetric row's quantization too), from ``int8_gemm.TILES_MIN_ROWS`` on its tiles after a row quantizer; the
rows between quantize and scale in ``kernels/int8_quant.py``'s launches around cuBLAS's int8 product. Rows with a
zero point each take the same launches: the quantizer stores the zero points, and the epilogue takes each times the
weight row's sum (computed once at load) off the int32 sums. Where a norm or gated activation kernel alone feeds a
linear with symmetric weights, it hands the rows over already quantized, zero points included
(``fused_rows.py``), and every path starts from them. All give the torch ops' bits.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels import int8_gemm, int8_quant
from pagedllm.kernels.cpu import int8_gemm as cpu_int8
from pagedllm.kernels.int8_quant import quantize_int8_rows
from pagedllm.kernels.row_quant import QuantizedRows
from pagedllm.layers.quantization.base import QuantizedLinearMethod
from pagedllm.layers.quantization.packed_params import PackedParam

# cuBLAS's int8 product takes more than 16 rows: fewer (decode) are padded with zero rows to this many, which
# costs nothing next to reading the weight, where the float fallback would convert the whole weight every call.
_INT_MM_MIN_ROWS = 32


def _int_mm_usable(xq: torch.Tensor, wq: torch.Tensor) -> bool:
    if xq.device.type == "cpu":
        return True
    # cuBLAS's int8 product: both inner and outer sizes multiples of 8.
    return xq.shape[1] % 8 == 0 and wq.shape[0] % 8 == 0


def _int_mm(xq: torch.Tensor, wq: torch.Tensor) -> torch.Tensor:  # [T, K] int8 x [N, K] int8 -> [T', N] int32
    """The exact int32 product; on CUDA its first T rows are the product (T' >= T rows, padded)."""
    if xq.is_cpu and cpu_int8.available():
        return cpu_int8.int8_mm(xq.contiguous(), wq.contiguous())
    if xq.is_cuda and xq.shape[0] < _INT_MM_MIN_ROWS:
        xq = F.pad(xq, (0, 0, 0, _INT_MM_MIN_ROWS - xq.shape[0]))
    return torch._int_mm(xq, wq.t())


def fuse_wanted(x: torch.Tensor, consumer: tuple[int, int] | None = None) -> bool:
    """Whether a producer flagged for a W8A8 linear with symmetric weights (whose weight's shape is ``consumer``)
    should hand these rows over as int8: on CUDA, in a type the row quantizer takes. Every CUDA path of
    ``w8a8_linear`` quantizes rows with ``int8_quant``'s arithmetic (the decode kernel, the tiles, the quantizer
    before cuBLAS, ``quantize_int8_rows``), so rows quantized by their producer give each path its own bits."""
    return x.is_cuda and x.dim() == 2 and x.shape[0] > 0 and int8_quant.usable(x) and (
        consumer is None or consumer[1] == x.shape[1])


def w8a8_linear(
    x: torch.Tensor | QuantizedRows,  # [T, K] (QuantizedRows: int8 rows a producer quantized, as act_symmetric)
    weight: torch.Tensor,  # [N, K] int8
    weight_scale: torch.Tensor,  # [N, 1]
    bias: torch.Tensor | None,  # [N]
    act_symmetric: bool,
    row_sums: torch.Tensor | None = None,  # [N] float32: the weight rows' sums, for asymmetric rows
) -> torch.Tensor:  # [T, N] in x's dtype
    rows = x if isinstance(x, QuantizedRows) else None
    if rows is None and x.is_cpu and act_symmetric and x.dtype == torch.float32 and cpu_int8.available():
        # The CPU's kernels, each the arithmetic of the torch ops below.
        xq, xs = cpu_int8.quantize_rows(x.contiguous())
        y = cpu_int8.scale_rows(cpu_int8.int8_mm(xq, weight.contiguous()), xs, weight_scale.float().contiguous())
        return y if bias is None else y + bias.float()
    sums = None if act_symmetric else row_sums
    if rows is not None or (int8_quant.usable(x) and (act_symmetric or sums is not None)):
        if int8_gemm.usable(x, weight):
            # Decode rows: one or two launches, where the path below takes four and cuBLAS's int8 product is
            # slow on a few rows. The same arithmetic.
            return int8_gemm.w8a8_decode(x, weight, weight_scale.float(), bias, weight_row_sums=sums)
        if int8_gemm.tiles_usable(x, weight):
            # Many rows (a large decode batch, a prompt chunk): two launches, faster than cuBLAS's int8 product.
            return int8_gemm.w8a8_tiles(x, weight, weight_scale.float(), bias, weight_row_sums=sums)
        if _int_mm_usable(rows.q if rows is not None else x, weight):
            # One launch quantizes the rows, one scales the product back: the same arithmetic as below.
            if rows is not None:
                xq, xs, xz = rows.q, rows.scales, rows.zeros
            elif sums is not None:
                xq, xs, xz = int8_quant.quantize_rows_with_zeros(x)
            else:
                (xq, xs), xz = int8_quant.quantize_rows(x), None
            return int8_quant.scale_rows(_int_mm(xq, weight), xs, weight_scale, bias, x.dtype, xz, sums)
    if rows is not None:
        xq, xs, xz = rows.q, rows.scales, rows.zeros
    else:
        xq, xs, xz = quantize_int8_rows(x, act_symmetric)
    if _int_mm_usable(xq, weight):
        acc = _int_mm(xq, weight)[: xq.shape[0]]  # [T, N] int32, exact
    else:
        acc = (xq.float() @ weight.float().t()).round().to(torch.int32)
    y = acc.float()
    if xz is not None:
        if row_sums is None:
            row_sums = weight.sum(dim=1, dtype=torch.int32).float()
        y = y - xz * row_sums[None, :]
    y = y * xs * weight_scale.float().view(1, -1)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


class W8A8Int8LinearMethod(QuantizedLinearMethod):
    """``act``: ``"symmetric"`` or ``"asymmetric"`` per-token activations, or None (weight-only, W8A16)."""

    experts_as_linears = True

    def __init__(self, act: str | None = "symmetric", weight_symmetric: bool = True) -> None:
        self.act = act
        self.weight_symmetric = weight_symmetric

    def packed_params(self, input_size: int, output_size: int, full_input_size: int) -> list[PackedParam]:
        params = [
            PackedParam("weight", (output_size, input_size), torch.int8, 0, 1, 1, 1),
            PackedParam("weight_scale", (output_size, 1), torch.float32, 0, 1),
        ]
        if not self.weight_symmetric:
            params.append(PackedParam("weight_zero_point", (output_size, 1), torch.int8, 0, 1))
        return params

    def dequantize(self, layer: nn.Module) -> torch.Tensor:  # [N, K]
        w = layer.weight.float()
        if not self.weight_symmetric:
            w = w - layer.weight_zero_point.float()
        return w * layer.weight_scale.float()

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.act == "asymmetric" and self.weight_symmetric:
            # Each weight row's sum, which each row's zero point multiplies in the product: once, not every call.
            layer.register_buffer("weight_row_sums", layer.weight.data.sum(dim=1, dtype=torch.int32).float(),
                                  persistent=False)

    def quantized_input(self, layer: nn.Module) -> str | None:
        # Symmetric weights: the products that take rows a producer quantized (w8a8_linear), with zero points or not.
        if self.act is None or not self.weight_symmetric:
            return None
        return "int8" if self.act == "symmetric" else "int8_zp"

    def apply(self, layer: nn.Module, x: torch.Tensor | QuantizedRows, bias: torch.Tensor | None) -> torch.Tensor:
        if self.act is None:
            return F.linear(x, self.dequantize(layer).to(x.dtype), bias)
        if self.weight_symmetric and x.shape[0] > 0:
            return w8a8_linear(x, layer.weight, layer.weight_scale, bias, self.act == "symmetric",
                               getattr(layer, "weight_row_sums", None))
        xq, xs, xz = quantize_int8_rows(x, self.act == "symmetric")
        xd = (xq.float() - (xz if xz is not None else 0)) * xs
        return F.linear(xd, self.dequantize(layer), None if bias is None else bias.float()).to(x.dtype)

    @staticmethod
    def quantize_loaded(layer: nn.Module) -> None:
        """``--quantization int8``: replaces ``layer.weight`` [N, K] by its int8 rows and adds ``weight_scale`` [N, 1]."""
        q, scale, _ = quantize_int8_rows(layer.weight.data, symmetric=True)
        layer.weight = nn.Parameter(q, requires_grad=False)
        layer.weight_scale = nn.Parameter(scale, requires_grad=False)
