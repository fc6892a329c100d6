"""The attention layer of a model: takes its flat q, k, v projections with its q/k norm and rotary modules,
reshapes them into heads and hands them to the backend's impl, which applies the modules, fused or not."""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.attention.backend import AttentionBackend, QKTransform
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.kernels.attention.fused_inputs import QKNorm, Rope
from pagedllm.layers.norm import GemmaRMSNorm, RMSNorm
from pagedllm.layers.rotary import RotaryEmbedding


def qk_transform(
    rotary: nn.Module | None, q_norm: nn.Module | None, k_norm: nn.Module | None, head_size: int
) -> QKTransform:
    """The modules, and as numbers what of them a kernel computes exactly: a neox-style ``RotaryEmbedding``
    over heads of ``head_size`` with float32 frequencies, and a pair of ``RMSNorm`` or of ``GemmaRMSNorm`` over
    ``head_size`` channels. Exact classes only: a subclass may apply its weight or angles otherwise."""
    rope = norm = None
    if (type(rotary) is RotaryEmbedding and rotary.is_neox_style and rotary.head_size == head_size
            and rotary.inv_freq.dtype == torch.float32):
        rope = Rope(rotary.inv_freq, rotary.attention_scaling)
    kind = type(q_norm)
    if kind in (RMSNorm, GemmaRMSNorm) and type(k_norm) is kind and q_norm.hidden_size == k_norm.hidden_size == head_size:
        norm = QKNorm(q_norm.weight, k_norm.weight, q_norm.eps, k_norm.eps, kind is GemmaRMSNorm)
    return QKTransform(rotary, q_norm, k_norm, rope, norm)


class Attention(nn.Module):
    """Paged attention of one layer. It owns no weights; the KV cache is passed in on every call."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        attn_backend: type[AttentionBackend],
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        self.backend = attn_backend
        self.impl = attn_backend.get_impl_cls()(
            num_heads, head_size, scale, num_kv_heads, sliding_window, logits_soft_cap
        )
        # The float8 cache holds k / k_scale and v / v_scale (``layers/kv_scales.py``); 1.0 unless a
        # checkpoint carries scales and the cache is float8.
        self.k_scale = 1.0
        self.v_scale = 1.0
        self._scaled_norms: tuple | None = None  # (q_norm, k_norm, their copies with k_scale folded in)
        self._qk: tuple | None = None  # (the modules and tensors it was made from, QKTransform)

    def forward(
        self,
        positions: torch.Tensor,  # [T] int64
        query: torch.Tensor,  # [T, Hq*D], before q_norm and rotary; may be a strided view of a qkv output
        key: torch.Tensor,  # [T, Hkv*D], before k_norm and rotary; likewise
        value: torch.Tensor,  # [T, Hkv*D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        attn_metadata: AttentionMetadata,
        rotary: nn.Module | None = None,  # (positions, q, k) -> (q, k), e.g. a RotaryEmbedding
        q_norm: nn.Module | None = None,  # per-head norm of q ([T, Hq, D]), applied before rotary
        k_norm: nn.Module | None = None,  # per-head norm of k ([T, Hkv, D]), applied before rotary
    ) -> torch.Tensor:  # [T, Hq*D]
        """Attention of ``rotary(positions, q_norm(query), k_norm(key))`` and ``value``, whichever modules are
        given. The backend applies them, in its own launches where it can (``AttentionImpl.forward_qk``);
        query and key may be rewritten in place."""
        num_tokens = query.shape[0]
        scaled_v = self.v_scale != 1.0
        if self.k_scale != 1.0:
            # Per-head norms undo a scale on their input: fold it into their weights instead.
            if q_norm is not None or k_norm is not None:
                q_norm, k_norm = self._norms_with_k_scale(q_norm, k_norm)
            else:
                query = query * self.k_scale
                key = key / self.k_scale
        if scaled_v:
            value = value / self.v_scale
        out = self.impl.forward_qk(
            positions,
            query.view(num_tokens, self.num_heads, self.head_size),
            key.view(num_tokens, self.num_kv_heads, self.head_size),
            value.view(num_tokens, self.num_kv_heads, self.head_size),
            kv_cache,
            attn_metadata,
            self._qk_transform(rotary, q_norm, k_norm),
        )
        out = out.reshape(num_tokens, self.num_heads * self.head_size)
        return out * self.v_scale if scaled_v else out

    def _qk_transform(self, rotary: nn.Module | None, q_norm: nn.Module | None, k_norm: nn.Module | None) -> QKTransform:
        """``qk_transform`` of the modules, made once: a decode step calls every layer with the same ones."""
        source = (rotary, q_norm, k_norm, getattr(rotary, "inv_freq", None), getattr(q_norm, "weight", None),
                  getattr(k_norm, "weight", None))
        cached = self._qk
        if cached is None or any(a is not b for a, b in zip(cached[0], source)):
            cached = self._qk = (source, qk_transform(rotary, q_norm, k_norm, self.head_size))
        return cached[1]

    def _norms_with_k_scale(self, q_norm: nn.Module | None, k_norm: nn.Module | None) -> tuple:
        cached = self._scaled_norms
        if cached is None or cached[0] is not q_norm or cached[1] is not k_norm:
            cached = (q_norm, k_norm, _scaled_norm(q_norm, self.k_scale), _scaled_norm(k_norm, 1.0 / self.k_scale))
            self._scaled_norms = cached
        return cached[2], cached[3]

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_size={self.head_size}, "
            f"scale={self.scale:.4g}, sliding_window={self.sliding_window}, "
            f"soft_cap={self.logits_soft_cap}, backend={getattr(self.backend, 'name', self.backend.__name__)}"
        )


def _scaled_norm(norm: nn.Module | None, factor: float) -> nn.Module | None:
    """A copy of a per-head RMS norm whose output is ``factor`` times the original's."""
    if norm is None or factor == 1.0:
        return norm
    import copy

    scaled = copy.deepcopy(norm)
    with torch.no_grad():
        if type(norm) is GemmaRMSNorm:  # output * (1 + w)
            scaled.weight.copy_((1.0 + norm.weight.float()) * factor - 1.0)
        elif type(norm) is RMSNorm:
            scaled.weight.mul_(factor)
        else:
            raise NotImplementedError(f"KV-cache scales with a {type(norm).__name__} q/k norm; supported: RMSNorm, "
                                      f"GemmaRMSNorm")
    return scaled
