"""The quantization-method interface: a config per ``quant_method`` parsed from a checkpoint's ``quantization_config``
(``registry.py`` finds it by name), and the linear method a config gives each layer.

A method's linear states every parameter it owns as a ``PackedParam`` (``packed_params.py``): its shape and
which of its dimensions index output and input channels, and how many channels one index covers. The
loader places checkpoint shards (q/k/v, gate/up) and tensor-parallel slices from that statement alone.
"""
from __future__ import annotations

import functools
import itertools
import logging
import re
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.linear import LinearBase, LinearMethodBase, UnquantizedLinearMethod
from pagedllm.layers.quantization.packed_params import PackedParam, load_packed

logger = logging.getLogger("pagedllm")

class QuantizationConfig:
    """What a checkpoint's ``quantization_config`` says about its linears."""

    name: str = ""
    # The engine's name for the checkpoint's quantization (ModelConfig.quantization).
    engine_method: str = ""
    # Online rotations around the linears (compressed-tensors' transform_config, ``transforms.py``), or None.
    transforms = None

    def __init__(self, ignore: tuple[str, ...] = ()) -> None:
        self.ignore = ignore
        self.notes: list[str] = []  # what of the checkpoint goes unused, logged once at load

    @classmethod
    def from_config(cls, cfg: dict) -> QuantizationConfig:
        raise NotImplementedError

    def linear_method(self) -> LinearMethodBase:
        """The method of every linear built for this checkpoint (those ``ignores`` names are reverted after)."""
        raise NotImplementedError

    def skip_suffixes(self) -> tuple[str, ...]:
        """Checkpoint tensor name endings the method does not read."""
        return ()

    def ignores(self, module_name: str) -> bool:
        """Whether the checkpoint keeps ``module_name`` unquantized: exact names, or ``re:`` regular expressions."""
        for entry in self.ignore:
            if entry.startswith("re:"):
                if re.fullmatch(entry[3:], module_name):
                    return True
            elif module_name == entry:
                return True
        return False


def config_error(method: str, field: str, value, supported: str) -> ValueError:
    return ValueError(f"quantization_config ({method}): {field} {value!r} is not supported; supported: {supported}")


class QuantizedLinearMethod(LinearMethodBase):
    """A linear stored quantized in the checkpoint. Subclasses list their parameters (``packed_params``) and
    dequantize them; ``apply`` here is the torch path (dequantize, then a float matmul), which is also the
    oracle any fused kernel is tested against. AWQ, GPTQ and pack-quantized weights take a Triton kernel on
    CUDA (``wna16_layout.py``); the other methods run this path there too."""

    # A checkpoint in this format stores each MoE expert's projections like its dense linears, and its experts
    # are built as linears of this method (``layers/fused_moe/linear_experts.py``).
    experts_as_linears: bool = False

    def packed_params(self, input_size: int, output_size: int, full_input_size: int) -> list[PackedParam]:
        """This rank's parameters, for ``input_size`` of the layer's ``full_input_size`` inputs."""
        raise NotImplementedError

    def create_weights(
        self, layer: nn.Module, input_size: int, output_size: int, bias: bool, params_dtype: torch.dtype
    ) -> None:
        for spec in self.packed_params(input_size, output_size, layer.input_size):
            dtype = params_dtype if spec.dtype is None else spec.dtype
            param = nn.Parameter(torch.empty(spec.shape, dtype=dtype), requires_grad=False)
            param.weight_loader = functools.partial(load_packed, layer, spec)
            setattr(layer, spec.name, param)
        if bias:
            layer.bias = nn.Parameter(torch.empty(output_size, dtype=params_dtype), requires_grad=False)
            layer.bias.weight_loader = layer.weight_loader
        else:
            layer.register_parameter("bias", None)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Checks or rearranges what was loaded; nothing by default."""

    def dequantize(self, layer: nn.Module) -> torch.Tensor:  # [N, K] float32
        raise NotImplementedError

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, self.dequantize(layer).to(x.dtype), bias)


def layer_device(layer: nn.Module) -> torch.device:
    """Where a linear's weight lives, in whatever form its method keeps it (a packed layout holds no parameters)."""
    packed = getattr(layer, "wna16", None)
    if packed is not None:
        return packed.device
    return next(itertools.chain(layer.parameters(recurse=False), layer.buffers(recurse=False))).device


def process_loaded_weights(model: nn.Module) -> None:
    """Runs each quantized linear's ``process_weights_after_loading`` once its checkpoint tensors are in, then
    each MoE experts method's (which may restack its experts' processed linears)."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, QuantizedLinearMethod):
            method.process_weights_after_loading(module)
    for module in list(model.modules()):
        process = getattr(getattr(module, "experts_method", None), "process_weights_after_loading", None)
        if process is not None:
            process(module)


def keep_ignored_unquantized(model: nn.Module, ignores: Callable[[str], bool]) -> None:
    """Gives the linears a quantized checkpoint lists as unquantized (``ignores(name)``) back a plain 16/32-bit
    weight. A fused layer counts as ignored when its own name or a checkpoint name it fuses is."""
    fused: dict[str, list[str]] = {}  # fused parameter's module name -> checkpoint module names it holds
    for param, ckpt, _ in getattr(model, "stacked_params_mapping", ()):
        fused.setdefault(param, []).append(ckpt)
    for name, layer in model.named_modules():
        if not isinstance(layer, LinearBase):
            continue
        parent, _, leaf = name.rpartition(".")
        names = [name] + [f"{parent}.{ckpt}" if parent else ckpt for ckpt in fused.get(leaf, [])]
        if not any(ignores(n) for n in names):
            continue
        n_in = getattr(layer, "input_size_per_partition", layer.input_size)
        n_out = getattr(layer, "output_size_per_partition", layer.output_size)
        device = next(layer.parameters()).device
        has_bias = getattr(layer, "bias", None) is not None
        for pname, _ in list(layer.named_parameters(recurse=False)):
            delattr(layer, pname)
        layer.quant_method = UnquantizedLinearMethod()
        with torch.device(device):
            layer.quant_method.create_weights(layer, n_in, n_out, has_bias, layer.params_dtype)
        layer.keep_unquantized = True
