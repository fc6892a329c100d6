"""Weight quantization: the pass that quantizes a loaded model for an online method (``--quantization fp8``/``int8``);
the methods checkpoints store are in this package's modules, found by ``quant_method`` in ``registry.py``."""
from __future__ import annotations

import logging

import torch
from torch import nn

from pagedllm.config import ONLINE_QUANTIZATION_METHODS, QUANTIZATION_METHODS

logger = logging.getLogger("pagedllm")


def quantize_model(model: nn.Module, method: str, int8_activations: bool = False) -> int:
    """Quantizes every linear layer of ``model`` that ``method`` can hold, in place, one layer at a time
    (so the peak is the loaded model plus one layer); layers a float8 checkpoint already filled stay as
    they are (``int8_activations``: int4's CPU products take 8-bit activations). Returns how many layers it
    quantized."""
    from pagedllm.layers.linear import LinearBase
    from pagedllm.layers.quantization.base import QuantizedLinearMethod
    from pagedllm.layers.quantization.fp8 import Fp8LinearMethod, quantizable

    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}; got {method!r}")
    if method not in ONLINE_QUANTIZATION_METHODS:
        return 0  # the checkpoint stored its linears quantized; the loader filled them as they are
    if method in ("int8", "int4"):
        return _quantize_integer(model, method, int8_activations)
    done, kept = 0, []
    for name, layer in model.named_modules():
        if not isinstance(layer, LinearBase) or getattr(layer, "keep_unquantized", False):
            continue
        if isinstance(layer.quant_method, QuantizedLinearMethod):
            continue  # stored quantized another way (block-wise float8)
        if isinstance(layer.quant_method, Fp8LinearMethod) and layer.weight.dtype == torch.float8_e4m3fn:
            continue  # loaded in float8 from the checkpoint
        if not quantizable(layer):
            kept.append(name)
            continue
        layer.quant_method = Fp8LinearMethod()
        layer.quant_method.process_weights_after_loading(layer)
        done += 1
    from pagedllm.layers.fused_moe import MoEExperts

    for module in model.modules():
        if (isinstance(module, MoEExperts) and module.experts_method is None
                and module.w13_weight.dtype != torch.float8_e4m3fn):  # not held as GGUF blocks or linears
            module.quantize_fp8()  # float8 experts with a scale per expert and output row
            done += 1
    if kept:
        logger.info("quantization %s: %d linear layers kept in %s (dimensions not multiples of 16): %s",
                    method, len(kept), next(model.parameters()).dtype, ", ".join(kept[:4]))
    device = next(model.parameters()).device
    if device.type == "cpu":
        logger.warning("quantization %s on the CPU: products run dequantized in float32, slower than the "
                       "unquantized model; the float8 weights save memory only", method)
    if device.type == "cuda":
        from pagedllm.layers.quantization.fp8 import float8_products

        if not float8_products(device.index or 0):
            logger.warning("quantization %s: this GPU has no float8 tensor cores (compute capability < 8.9); "
                           "products run dequantized in float32, slower than the unquantized model", method)
        torch.cuda.empty_cache()  # the 16-bit weights' memory goes back for the KV cache
    return done


def _quantize_integer(model: nn.Module, method: str, int8_activations: bool = False) -> int:
    """Every 16/32-bit decoder linear to int8 rows with a scale each, activations quantized per token (W8A8), or
    to 4-bit weights only (``int4.py``)."""
    from pagedllm.layers.linear import LinearBase, UnquantizedLinearMethod
    from pagedllm.layers.quantization import int4
    from pagedllm.layers.quantization.int8 import W8A8Int8LinearMethod

    done, kept = 0, []
    for name, layer in model.named_modules():
        if not isinstance(layer, LinearBase) or getattr(layer, "keep_unquantized", False):
            continue
        if not isinstance(layer.quant_method, UnquantizedLinearMethod) or layer.weight.dim() != 2:
            continue
        if method == "int4":
            if not int4.quantizable(layer):
                kept.append(name)
                continue
            layer.quant_method = int4.Int4LinearMethod(int8_activations)
            int4.Int4LinearMethod.quantize_loaded(layer)
        else:
            layer.quant_method = W8A8Int8LinearMethod("symmetric")
            W8A8Int8LinearMethod.quantize_loaded(layer)
        done += 1
    if method == "int4" and next(model.buffers(), torch.empty(0)).device.type == "cpu":
        from pagedllm.kernels.cpu.hugepages import move_to_huge_pages

        move_to_huge_pages(model, ("qweight_",))  # the Q4_0 rows every decode step streams
    if kept:
        logger.info("quantization int4: %d linear layers kept unquantized (inputs not a multiple of the 4-bit "
                    "block): %s", len(kept), ", ".join(kept[:4]))
    if next(model.parameters()).device.type == "cuda":
        torch.cuda.empty_cache()
    return done
