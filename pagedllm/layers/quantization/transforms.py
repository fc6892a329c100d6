"""Online rotations of compressed-tensors checkpoints (``transform_config``: llm-compressor's QuIP-style Hadamard
transforms): a matrix a linear multiplies its input by before its product, or its output by after it.

A checkpoint made with transforms stores its weights already rotated (the ``weight_input``/``weight_output`` half of
each pair is fused offline); the other half runs at inference: a linear's input ``x`` becomes ``x V`` and its
output ``y`` becomes ``y U``, with V and U block-diagonal in blocks of ``head_dim`` (the whole dimension when
unset). Rotating a linear's input spreads its outlier channels over the block, so its per-token int8 rounding loses
far less: W8A8 on Gemma 3 270M costs 1.19x float32's perplexity rounded plainly, 1.01x with the inputs rotated.

compressed-tensors keeps one matrix per config group and size (every transform of the group with that size
shares it, and its permutation) and saves it once, under the first module using it; a linear without its own copy
takes its group's matrix of its size. Hadamard matrices are stored with entries of +-1 and scaled by 1/sqrt(size)
when applied; ``randomize`` permutes their rows and columns by the stored ``perm``; ``inverse`` applies the
transpose. A ``random-matrix`` transform stores the matrix it applies (the inverse one where ``inverse``).
"""
from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.layers.linear import LinearBase, LinearMethodBase, RowParallelLinear
from pagedllm.layers.quantization.base import config_error, layer_device

TYPES = ("hadamard", "random-hadamard", "random-matrix")
ONLINE = ("input", "output")
OFFLINE = ("weight_input", "weight_output")  # fused into the stored weights when the checkpoint was made


def _err(field: str, value, supported: str) -> ValueError:
    return config_error("compressed-tensors", f"transform_config.{field}", value, supported)


@dataclass(frozen=True)
class OnlineTransform:
    """One online half of a config group's transform, as its ``apply`` entry states it."""

    group: str
    kind: str  # one of TYPES
    location: str  # "input" or "output"
    inverse: bool
    targets: tuple[str, ...]
    ignore: tuple[str, ...]
    head_dim: int | None
    precision: torch.dtype
    randomize: bool

    def matches(self, module_name: str) -> bool:
        """compressed-tensors' matching of a linear: its class name ``Linear``, its exact name, or ``re:`` from the
        name's start."""
        def hit(entries: tuple[str, ...]) -> bool:
            return any(e == "Linear" or e == module_name or (e.startswith("re:") and re.match(e[3:], module_name))
                       for e in entries)

        return hit(self.targets) and not hit(self.ignore)


def _precision(value, field: str) -> torch.dtype:
    name = str(value).removeprefix("torch.")
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise _err(field, value, "a float dtype such as 'torch.float32'")
    return dtype


class TransformConfig:
    """The online transforms of a checkpoint's ``transform_config``."""

    def __init__(self, online: list[OnlineTransform]) -> None:
        self.online = online
        self.groups = sorted({t.group for t in online})

    @classmethod
    def from_config(cls, cfg: dict | None) -> TransformConfig | None:
        groups = (cfg or {}).get("config_groups") or {}
        if not isinstance(groups, dict):
            raise _err("config_groups", groups, "a mapping of group names to schemes")
        online: list[OnlineTransform] = []
        for name, scheme in groups.items():
            where = f"config_groups[{name!r}]"
            kind = scheme.get("type")
            if kind not in TYPES:
                raise _err(f"{where}.type", kind, ", ".join(TYPES))
            head_dim = scheme.get("head_dim")
            if head_dim is not None and not (isinstance(head_dim, int) and head_dim > 0):
                raise _err(f"{where}.head_dim", head_dim, "a positive block size, or null")
            precision = _precision(scheme.get("precision", "torch.float32"), f"{where}.precision")
            for i, args in enumerate(scheme.get("apply") or []):
                location = args.get("location")
                if location in OFFLINE:
                    continue
                if location not in ONLINE:
                    raise _err(f"{where}.apply[{i}].location", location,
                               "input, output, weight_input, weight_output (rotations inside attention are not)")
                targets = args.get("targets") or []
                ignore = args.get("ignore") or []
                online.append(OnlineTransform(
                    name, kind, location, bool(args.get("inverse", False)),
                    tuple([targets] if isinstance(targets, str) else targets),
                    tuple([ignore] if isinstance(ignore, str) else ignore), head_dim, precision,
                    bool(scheme.get("randomize", False))))
        return cls(online) if online else None

    def tensor_suffixes(self) -> tuple[str, ...]:
        """Endings of the checkpoint tensors that hold this config's matrices and permutations."""
        return tuple(f".{g}_{loc}.{p}" for g in self.groups for loc in ONLINE + OFFLINE for p in ("weight", "perm"))


def collect_transforms(weights: Iterable[tuple[str, torch.Tensor]], config: TransformConfig,
                       found: dict[tuple[str, str, str], dict[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Passes every tensor on except the transforms' own, which go into ``found`` as {(module, group, location):
    {"weight"/"perm": tensor}}."""
    suffixes = config.tensor_suffixes()
    for name, tensor in weights:
        if not name.endswith(suffixes):
            yield name, tensor
            continue
        holder, part = name.rsplit(".", 1)
        module, _, key = holder.rpartition(".")
        # "<group>_<location>": the group is whichever of the config's names that leaves a location
        group = next(g for g in config.groups if key.startswith(g + "_") and key[len(g) + 1:] in ONLINE + OFFLINE)
        found.setdefault((module, group, key[len(group) + 1:]), {})[part] = tensor


class Rotation:
    """``x`` [..., D] -> ``x`` times the block-diagonal matrix of ``block`` [n, n] blocks (n divides D), then divided
    by ``divisor``, computed in the block's dtype and returned in x's (compressed-tensors' order of operations)."""

    def __init__(self, block: torch.Tensor, divisor: float) -> None:
        self.block, self.divisor = block, divisor

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [..., D] -> [..., D]
        n = self.block.shape[0]
        y = x.to(self.block.dtype).reshape(*x.shape[:-1], x.shape[-1] // n, n) @ self.block
        if self.divisor != 1.0:
            y = y / self.divisor
        return y.reshape(x.shape).to(x.dtype)


class RotatedLinearMethod(LinearMethodBase):
    """A linear's own method with its online transforms around it: the input rotated before the product, and each
    output shard (q/k/v, gate/up, or the whole output) after it."""

    def __init__(self, inner: LinearMethodBase, rotate_input: Rotation | None,
                 rotate_outputs: list[tuple[int, Rotation | None]] | None) -> None:
        self.inner, self.rotate_input, self.rotate_outputs = inner, rotate_input, rotate_outputs

    def create_weights(self, *args, **kwargs) -> None:
        self.inner.create_weights(*args, **kwargs)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:  # [T, K] -> [T, N]
        if self.rotate_input is not None:
            x = self.rotate_input(x)
        y = self.inner.apply(layer, x, bias)
        if self.rotate_outputs is None:
            return y
        pieces = y.split([size for size, _ in self.rotate_outputs], dim=-1)
        return torch.cat([p if r is None else r(p) for p, (_, r) in zip(pieces, self.rotate_outputs)], dim=-1)


def _shards(model: nn.Module, name: str, layer: LinearBase) -> list[tuple[str, int, int]]:
    """(checkpoint module name, full output size, this rank's output size) of each projection ``layer`` fuses, in
    output order; one entry for a plain linear."""
    parent, _, leaf = name.rpartition(".")
    fused = [ckpt for param, ckpt, _ in getattr(model, "stacked_params_mapping", ()) if param == leaf]
    tp = layer.tp_size
    if not fused:
        local = getattr(layer, "output_size_per_partition", layer.output_size)
        return [(name, layer.output_size, local)]
    full = [f"{parent}.{c}" if parent else c for c in fused]
    if hasattr(layer, "q_size"):  # QKV: the kv heads may be replicated across ranks
        d = layer.head_size
        sizes = [layer.total_num_heads * d, layer.total_num_kv_heads * d, layer.total_num_kv_heads * d]
        return list(zip(full, sizes, [layer.q_size, layer.kv_size, layer.kv_size]))
    return [(n, s, s // tp) for n, s in zip(full, layer.output_sizes)]


def _sylvester(size: int) -> torch.Tensor:  # [size, size] of +-1, size a power of two
    m = torch.ones(1, 1, dtype=torch.float64)
    while m.shape[0] < size:
        m = torch.cat([torch.cat([m, m], 1), torch.cat([m, -m], 1)], 0)
    return m


def _matrix(entry: dict[str, torch.Tensor] | None, t: OnlineTransform, size: int, where: str) -> torch.Tensor:
    """The [size, size] matrix ``t`` applies (before its division by ``_divisor``), float64, from its stored tensors
    (or Sylvester's Hadamard matrix, which a deterministic ``hadamard`` scheme without permutations need not store)."""
    if entry is None or "weight" not in entry:
        if t.kind != "hadamard" or t.randomize:
            raise ValueError(f"compressed-tensors transform: the checkpoint holds no matrix for {where} "
                             f"(group {t.group!r}, {t.location}, size {size})")
        if size & (size - 1):
            raise _err(f"config_groups[{t.group!r}].type", "hadamard", f"a power-of-two size (got {size} at {where})")
        entry = {"weight": _sylvester(size)}
    m = entry["weight"].to(torch.float64)
    if tuple(m.shape) != (size, size):
        raise ValueError(f"compressed-tensors transform of {where}: matrix {tuple(m.shape)}, expected ({size}, {size})")
    if t.kind == "random-matrix":
        return m  # stored as applied, its inverse included
    if t.randomize:
        if "perm" not in entry:
            raise ValueError(f"compressed-tensors transform of {where}: randomized, but no permutation is stored")
        perm = entry["perm"].long()
        m = m[perm][:, perm]
    if t.inverse:
        m = m.t()
    return m


def _divisor(t: OnlineTransform, size: int) -> float:
    return 1.0 if t.kind == "random-matrix" else math.sqrt(size)


def _compute_dtype(entry: dict[str, torch.Tensor] | None, t: OnlineTransform, device: torch.device) -> torch.dtype:
    """compressed-tensors computes a rotation in its matrix's dtype: the scheme's precision, or float64 where the
    matrix is shared with the offline half of its pair and was made first for it (stored so). CUDA takes float32
    for those: float64 products run at a fraction of the rate there."""
    stored = None if entry is None or "weight" not in entry else entry["weight"].dtype
    dtype = stored if stored is not None and stored.is_floating_point else t.precision
    return torch.float32 if dtype == torch.float64 and device.type == "cuda" else dtype


def attach_transforms(model: nn.Module, config: TransformConfig,
                      found: dict[tuple[str, str, str], dict[str, torch.Tensor]]) -> int:
    """Wraps the method of every linear the config rotates in a ``RotatedLinearMethod``; returns how many. Refuses
    what the engine cannot rotate as the checkpoint says (MoE experts, the LM head, fused projections whose inputs
    are rotated differently, a stored matrix no linear takes)."""
    if any(hasattr(m, "experts_method") for m in model.modules()):
        raise ValueError("compressed-tensors transform_config: online transforms of MoE checkpoints are not supported")
    for t in config.online:
        if t.matches("lm_head"):
            raise _err(f"config_groups[{t.group!r}] targets", list(t.targets), "linears of the decoder layers "
                       "(ignore lm_head)")
    # A group's matrix of each size (and, for random matrices, direction), wherever the checkpoint stored it.
    online = {(t.group, t.location): t for t in config.online}
    shared: dict[tuple, dict[str, torch.Tensor]] = {}
    for (module, group, location), entry in found.items():
        t = online.get((group, location))
        if t is None or "weight" not in entry:
            continue
        key = (group, entry["weight"].shape[0], t.inverse if t.kind == "random-matrix" else None)
        shared.setdefault(key, entry)

    used: set[tuple[str, str, str]] = set()
    # One rotation on the device per distinct matrix: every layer shares its group's (a full-size rotation of an
    # 8B's 14336 MLP inputs is 822 MB in float32).
    rotations: dict[tuple, Rotation] = {}
    count = 0
    for name, layer in model.named_modules():
        if not isinstance(layer, LinearBase):
            continue
        shards = _shards(model, name, layer)
        device = layer_device(layer)

        def resolve(location: str, module: str, size: int) -> Rotation | None:
            ts = [t for t in config.online if t.location == location and t.matches(module)]
            if not ts:
                return None
            if len(ts) > 1:
                raise ValueError(f"compressed-tensors transform_config: {module} has {len(ts)} online {location} "
                                 f"transforms; pagedllm applies one")
            t = ts[0]
            n = t.head_dim or size
            if size % n:
                raise _err(f"config_groups[{t.group!r}].head_dim", t.head_dim, f"a divisor of {size} ({module})")
            key = (module, t.group, t.location)
            entry = found.get(key)
            if entry is not None:
                used.add(key)
            else:
                entry = shared.get((t.group, n, t.inverse if t.kind == "random-matrix" else None))
            dtype = _compute_dtype(entry, t, device)
            key = (id(entry), t.kind, t.inverse, t.randomize, n, dtype)
            if key not in rotations:
                rotations[key] = Rotation(_matrix(entry, t, n, module).to(device=device, dtype=dtype), _divisor(t, n))
            return rotations[key]

        # The input: one rotation, the same for every projection a fused layer holds.
        inputs = [resolve("input", module, layer.input_size) for module, _, _ in shards]
        rotate_input = None
        if any(r is not None for r in inputs):
            first = inputs[0]
            if any(r is None or first is None or r.divisor != first.divisor or not torch.equal(r.block, first.block)
                   for r in inputs):
                raise ValueError(f"compressed-tensors transform_config: {', '.join(s[0] for s in shards)} are fused "
                                 f"into {name} but their inputs are not rotated alike")
            local_in = getattr(layer, "input_size_per_partition", layer.input_size)
            if local_in % first.block.shape[0]:
                raise ValueError(f"compressed-tensors transform of {name}: blocks of {first.block.shape[0]} do not "
                                 f"divide this rank's {local_in} inputs")
            rotate_input = first

        # The outputs: each projection its own rotation (or none).
        outputs: list[tuple[int, Rotation | None]] = []
        for module, full, local in shards:
            r = resolve("output", module, full)
            if r is None:
                outputs.append((local, None))
                continue
            if local % r.block.shape[0]:
                raise ValueError(f"compressed-tensors transform of {module}: blocks of {r.block.shape[0]} do not "
                                 f"divide this rank's {local} outputs")
            if isinstance(layer, RowParallelLinear) and layer.tp_size > 1 and layer.bias is not None:
                raise ValueError(f"compressed-tensors transform of {module}: an output rotation of a row-parallel "
                                 f"linear with a bias under tensor parallelism is not supported")
            outputs.append((local, r))
        rotate_outputs = outputs if any(r is not None for _, r in outputs) else None
        if rotate_input is not None or rotate_outputs is not None:
            layer.quant_method = RotatedLinearMethod(layer.quant_method, rotate_input, rotate_outputs)
            count += 1
    # Matrices stored for an online transform that no linear took (offline ones are already in the weights).
    stray = sorted(m for (m, g, loc) in found if loc in ONLINE and (m, g, loc) not in used)
    if stray:
        raise ValueError(f"compressed-tensors transform_config: the checkpoint holds transforms of {', '.join(stray[:3])}"
                         f"{', ...' if len(stray) > 3 else ''}, which no linear of this model takes")
    return count
