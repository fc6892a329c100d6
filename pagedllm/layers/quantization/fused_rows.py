"""Which kernels hand their output to a float8 or int8 linear already quantized (``kernels/row_quant.py``).

A model names the (producer, linear) pairs where one module alone produces a linear's input: the norm before
q/k/v and before gate/up, the gated activation before down. After loading, each pair whose linear quantizes its
input per row (its method's ``quantized_input``) flags the producer with that kind; at run time the producer's
kernel stores the rows quantized exactly when the linear would quantize those rows itself (``rows_wanted``).
"""
from __future__ import annotations

import torch
from torch import nn


def flag_producers(model: nn.Module) -> int:
    """Sets ``quantize_output`` (the kind) and ``quantize_for`` (the linear's weight shape, outputs by inputs) on
    every producer whose consumer quantizes its input; returns how many it flagged."""
    flagged = 0
    for module in model.modules():
        for producer, consumer in getattr(module, "quantized_input_producers", lambda: [])():
            kind = consumer.quant_method.quantized_input(consumer)
            producer.quantize_output = kind
            producer.quantize_for = (getattr(consumer, "output_size_per_partition", consumer.output_size),
                                     getattr(consumer, "input_size_per_partition", consumer.input_size))
            flagged += kind is not None
    return flagged


def rows_wanted(
    kind: str | None,  # the producer's quantize_output
    x: torch.Tensor,  # [T, K]: the rows the producer computes
    consumer: tuple[int, int] | None,  # the linear's weight shape (outputs, inputs)
) -> bool:
    """Whether the producer should hand these rows over quantized as ``kind``."""
    if kind == "fp8":
        from pagedllm.layers.quantization.fp8 import fuse_wanted
    elif kind in ("int8", "int8_zp"):
        from pagedllm.layers.quantization.int8 import fuse_wanted
    else:
        return False
    return fuse_wanted(x, consumer)


def producer_quantization(module: nn.Module, x: torch.Tensor) -> str | None:
    """The ``quantize`` argument of a producer's kernel for rows ``x``: the kind, or None for 16-bit rows."""
    kind = module.quantize_output
    return kind if rows_wanted(kind, x, module.quantize_for) else None
