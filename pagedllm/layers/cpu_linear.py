"""Float32 matrix products on CPU through oneDNN, with weights reordered once into its blocked layout.

torch's CPU ``F.linear`` calls MKL's sgemm, which on the AMD EPYC (Zen 4) machines we measure on runs
1.5-2x slower than oneDNN for decoder-sized products and 2.2-2.7x slower for a 262k-row lm_head at
decode sizes (benchmarks/compare_hf.py). These are the ops inductor uses for frozen CPU linears.
Results differ from MKL's in summation order only (~1e-6 absolute on logits).
"""
from __future__ import annotations

import os
from typing import Any

import torch


def _has_op(namespace: Any, name: str) -> bool:
    try:
        return hasattr(namespace, name)
    except RuntimeError:  # an op namespace this build lacks
        return False


_ONEDNN_LINEAR = torch.backends.mkldnn.is_available() and _has_op(torch.ops.mkldnn, "_linear_pointwise")
_ONEDNN_PACK = _ONEDNN_LINEAR and _has_op(torch.ops.mkldnn, "_reorder_linear_weight")


class PackedWeight:
    """A dense [out, in] float32 weight reordered once into oneDNN's blocked layout, for ``cpu_linear``.

    Without it oneDNN reorders the weight on every call: at decode sizes (32 rows) that costs ~25% of
    the decoder's products and ~30% of the lm_head's. Packing happens at the first product, or before it
    through ``prepack`` (the CPU worker packs every weight at load), and is redone whenever the dense
    weight is replaced or written in place through the parameter; writes through ``param.data`` bypass
    the version counter, which is fine here since weights are fixed once loaded. The packed copy
    doubles the weight's memory, so a weight is packed only while RAM has room.
    """

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._packed: torch.Tensor | None = None

    def get(self, weight: torch.Tensor) -> torch.Tensor | None:  # [out, in] dense -> oneDNN tensor
        """The packed weight, or None when memory is too short for a second copy (use the dense one)."""
        # An inference tensor (made under inference_mode) has no version counter; it is never written.
        version = 0 if weight.is_inference() else weight._version
        key = (weight.data_ptr(), version, tuple(weight.shape))
        if key != self._key:
            self._key = key
            self._packed = None  # drop the old copy before judging room for the new one
            nbytes = weight.numel() * weight.element_size()
            # A model that fits RAM once must still load when it cannot fit twice: packing is only a speed-up.
            if available_ram_bytes() >= 2 * nbytes + _PACK_HEADROOM_BYTES:
                self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        return self._packed


def prepack(weight: torch.Tensor, packed: PackedWeight) -> bool:
    """Packs ``weight`` now if ``cpu_linear`` would use the packed copy; whether a copy was made."""
    usable = _ONEDNN_PACK and weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2
    return usable and packed.get(weight) is not None


# Memory left free after a packed copy is made: the KV cache, activations and the OS need room too.
_PACK_HEADROOM_BYTES = 2 << 30


def available_ram_bytes() -> int:
    """MemAvailable from /proc/meminfo (free plus reclaimable), or free pages where that is missing."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def cpu_linear(
    x: torch.Tensor,  # [T, in]
    weight: torch.Tensor,  # [out, in]
    bias: torch.Tensor | None,  # [out] or None
    packed: PackedWeight | None = None,
) -> torch.Tensor:  # [T, out]
    """``F.linear`` on CPU in float32 through oneDNN, else ``F.linear`` itself. Packed and unpacked
    oneDNN weights give identical results."""
    if (
        _ONEDNN_LINEAR
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and x.dim() == 2
        and x.shape[0] > 0
    ):
        if not x.is_contiguous():
            x = x.contiguous()
        w = packed.get(weight) if packed is not None and _ONEDNN_PACK else None
        if w is None:
            w = weight
        return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")
    return torch.nn.functional.linear(x, weight, bias)
