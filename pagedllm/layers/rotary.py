"""Rotary position embedding over flat token batches, with frequencies taken from transformers' RoPE initializers.

Using ``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS`` for the scaled variants (linear,
llama3, yarn, longrope, dynamic) means the inverse frequencies and the attention scaling are the
very numbers HF computes, and the cos/sin arithmetic below follows HF's op order, so float32
results match bit for bit.
"""
from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from pagedllm.kernels.cpu import norm_rope


class RotaryEmbedding(nn.Module):
    """Rotates the first ``rotary_dim`` channels of every head by position; the rest pass through."""

    def __init__(
        self,
        head_size: int,
        inv_freq: torch.Tensor,  # [rotary_dim / 2] float32
        attention_scaling: float = 1.0,
        is_neox_style: bool = True,
    ) -> None:
        super().__init__()
        self.head_size = head_size
        self.rotary_dim = 2 * inv_freq.numel()
        if self.rotary_dim > head_size:
            raise ValueError(f"rotary dim {self.rotary_dim} exceeds head size {head_size}")
        self.attention_scaling = float(attention_scaling)
        self.is_neox_style = is_neox_style
        # float32 and non-persistent: it is derived from the config, never read from a checkpoint.
        self.register_buffer("inv_freq", inv_freq.detach().to(torch.float32), persistent=False)
        # (positions, {dtype: (cos, sin)}) of the step in progress; see cache_positions.
        self._step_cache: tuple[torch.Tensor, dict] | None = None

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:  # each [T, rotary_dim / 2]
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]
        cos = freqs.cos() * self.attention_scaling
        sin = freqs.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x [T, H, D]; cos/sin [T, 1, R/2]
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        if self.is_neox_style:
            half = self.rotary_dim // 2
            x1, x2 = rot[..., :half], rot[..., half:]
            # HF's x * cat(cos, cos) + cat(-x2, x1) * cat(sin, sin), half by half and without the
            # concatenated copies: (-x2) * sin == -(x2 * sin) and a + (-b) == a - b exactly in IEEE
            # arithmetic, so float32 results stay bit-identical to HF's.
            out = torch.empty_like(x)
            o1, o2 = out[..., :half], out[..., half : self.rotary_dim]
            torch.mul(x1, cos, out=o1).sub_(x2 * sin)
            torch.mul(x2, cos, out=o2).add_(x1 * sin)
            if rest.shape[-1]:
                out[..., self.rotary_dim :] = rest
            return out
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        return out if rest.shape[-1] == 0 else torch.cat((out, rest), dim=-1)

    def cache_positions(self, positions: torch.Tensor | None) -> None:
        """Computes cos/sin for ``positions`` [T] once; CPU forwards given this very tensor reuse them.

        A model calls this before its layers (every layer of a step rotates at the same positions)
        and ``cache_positions(None)`` after them. The CUDA path computes cos/sin inside its kernel.
        """
        # Keyed by identity, not value: comparing positions would cost what the cache saves. Within one
        # forward nothing rewrites the positions tensor (inference tensors carry no version counter).
        self._step_cache = None if positions is None else (positions, {})

    def _cached_cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:  # each [T, 1, rotary_dim / 2]
        cache = self._step_cache
        if cache is not None and cache[0] is positions:
            if dtype not in cache[1]:
                cos, sin = self.cos_sin(positions, dtype)
                cache[1][dtype] = (cos.unsqueeze(1), sin.unsqueeze(1))
            return cache[1][dtype]
        cos, sin = self.cos_sin(positions, dtype)
        return cos.unsqueeze(1), sin.unsqueeze(1)

    def forward(
        self,
        positions: torch.Tensor,  # [T] int64
        query: torch.Tensor,  # [T, Hq, D] or [T, Hq*D]
        key: torch.Tensor,  # [T, Hkv, D] or [T, Hkv*D]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # same shapes as query, key
        """The rotated ``(query, key)``; on CUDA (neox style) and for float32 CPU tensors they are rotated in
        place and returned."""
        if query.is_cuda:
            # One Triton launch (cos/sin included) rotating q and k in place, instead of ~22 torch kernels.
            from pagedllm.kernels import rotary as kernel

            if kernel.usable(query, key, positions, self.head_size, self.is_neox_style):
                return kernel.rotary_neox_(positions, query, key, self.inv_freq, self.head_size, self.attention_scaling)
        cos, sin = self._cached_cos_sin(positions, query.dtype)
        # One C pass over q and k in place, bit-identical to _rotate's arithmetic, instead of ~10 torch ops
        # and their temporaries per call (exact class only: a subclass may rotate otherwise).
        if type(self) is RotaryEmbedding and norm_rope.rotary_pair_if_usable(
                query, key, cos, sin, self.head_size, self.is_neox_style):
            return query, key
        q = self._rotate(query.unflatten(-1, (-1, self.head_size)) if query.dim() == 2 else query, cos, sin)
        k = self._rotate(key.unflatten(-1, (-1, self.head_size)) if key.dim() == 2 else key, cos, sin)
        return q.reshape(query.shape), k.reshape(key.shape)

    def extra_repr(self) -> str:
        return (
            f"head_size={self.head_size}, rotary_dim={self.rotary_dim}, "
            f"scaling={self.attention_scaling}, neox={self.is_neox_style}"
        )


def rope_parameters(hf_config: Any, layer_type: str | None = None) -> dict:
    """The RoPE parameter dict of a transformers 5 config (``config.rope_parameters``, maybe per layer type)."""
    params = getattr(hf_config, "rope_parameters", None)
    if params is None:
        # A config without the transformers 5 field: rebuild it from the legacy attributes.
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = params[layer_type]
    params = dict(params)
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def compute_inv_freq(
    hf_config: Any,
    head_size: int,
    max_position: int,
    layer_type: str | None = None,
) -> tuple[torch.Tensor, float]:  # inv_freq [rotary_dim / 2] float32, attention scaling
    """Inverse frequencies and cos/sin scaling exactly as HF's rotary embedding computes them at init."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = rope_parameters(hf_config, layer_type)
    rope_type = params["rope_type"]
    if rope_type == "default":
        base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        dim = int(head_size * params.get("partial_rotary_factor", 1.0))
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim))
        return inv_freq, 1.0
    if rope_type not in ROPE_INIT_FUNCTIONS:
        known = ", ".join(["default", *ROPE_INIT_FUNCTIONS])
        raise NotImplementedError(f"rope type {rope_type!r} is not supported; known: {known}")

    seq_len = None
    if rope_type == "dynamic" and max_position > hf_config.max_position_embeddings:
        # Dynamic NTK rescales with the running length; up to max_position_embeddings it is plain RoPE.
        raise NotImplementedError(
            f"dynamic rope scaling is only supported up to max_position_embeddings="
            f"{hf_config.max_position_embeddings}; got max_model_len={max_position}"
        )
    if rope_type == "longrope":
        # HF swaps short/long factors per forward by sequence length. A paged cache needs one fixed
        # choice: the short factors when every sequence fits the original window (exactly HF), else
        # the long ones (HF's choice for any sequence past the original window).
        original = params.get("original_max_position_embeddings") or getattr(
            hf_config, "original_max_position_embeddings", hf_config.max_position_embeddings
        )
        seq_len = original + 1 if max_position > original else None

    # HF's initializers standardize the config in place; keep the engine's config untouched.
    config = copy.deepcopy(hf_config)
    if getattr(config, "rope_parameters", None) is None:
        config.rope_parameters = params
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None, seq_len=seq_len, layer_type=layer_type)
    return inv_freq.to(device="cpu", dtype=torch.float32), float(scaling)


@contextlib.contextmanager
def cos_sin_once_per_step(
    rotary_embs: Iterable[RotaryEmbedding], positions: torch.Tensor
) -> Iterator[None]:  # positions [T]
    """Within the block, each CPU rotary module computes cos/sin for ``positions`` once, not once a layer
    (every layer of a step rotates at the same positions). On CUDA the kernels compute them in place."""
    ropes = [] if positions.is_cuda else list(rotary_embs)
    for rope in ropes:
        rope.cache_positions(positions)
    try:
        yield
    finally:
        for rope in ropes:
            rope.cache_positions(None)


def get_rope(
    hf_config: Any,
    head_size: int,
    max_position: int,
    layer_type: str | None = None,
    is_neox_style: bool = True,
) -> RotaryEmbedding:
    """The rotary embedding for a model (or one layer type of it, e.g. Gemma 3's sliding/global layers)."""
    inv_freq, scaling = compute_inv_freq(hf_config, head_size, max_position, layer_type)
    return RotaryEmbedding(head_size, inv_freq, scaling, is_neox_style)
