"""Which kernels hand their output to a float8 or int8 linear already quantized (``kernels/row_quant.py``).

A model names the (producer, linear) pairs where one module alone produces a linear's input: the norm before
q/k/v and before gate/up, the gated activation before down. After loading, each pair whose linear quantizes its
input per row (its method's ``quantized_input``) flags the producer with that kind; at run time the producer's
kernel stores the rows quantized exactly when the linear would quantize those rows itself
(``producer_quantization``).
"""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.layers.quantization import fp8, int8


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


def producer_quantization(module: nn.Module, x: torch.Tensor) -> str | None:
    """The ``quantize`` argument of a producer's kernel for rows ``x`` [T, K]: its kind where the linear it feeds
    would quantize these rows itself, else None (16-bit rows)."""
    kind = module.quantize_output
    if kind == "fp8":
        wanted = fp8.fuse_wanted(x, module.quantize_for)
    elif kind in ("int8", "int8_zp"):
        wanted = int8.fuse_wanted(x, module.quantize_for)
    else:
        return None
    return kind if wanted else None
