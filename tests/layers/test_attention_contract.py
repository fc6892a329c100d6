"""The model/backend contract: a model's attention module hands q, k, v and its q/k norm and rotary modules to
the Attention layer, and the backend applies them. Models hold no fusion logic; the CPU backends run the
modules as they are."""
from __future__ import annotations

import ast
import copy
from pathlib import Path

import pytest
import torch

import pagedllm.models
from pagedllm.attention.registry import get_attn_backend
from pagedllm.layers.attention import qk_transform
from pagedllm.layers.norm import GemmaRMSNorm, RMSNorm
from pagedllm.layers.rotary import RotaryEmbedding
from pagedllm.models.llama import LlamaAttention
from paged_batches import step_metadata

# What only a backend may know: its kernels, and how it fuses the modules it is given.
_BACKEND_ONLY_MODULES = ("pagedllm.kernels", "pagedllm.attention.backends")
_BACKEND_ONLY_WORDS = ("fuse", "written", "kernel", "forward_qk")


def _rope(head_size: int, rotary_dim: int | None = None, **kw) -> RotaryEmbedding:
    rotary_dim = rotary_dim or head_size
    return RotaryEmbedding(head_size, 1.0 / (1e4 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)),
                           **kw)


@pytest.mark.parametrize("path", sorted(Path(pagedllm.models.__file__).parent.glob("*.py")), ids=lambda p: p.name)
def test_models_hold_no_fusion_logic(path):
    # Adding an architecture must not need the backend's kernels or capabilities: no import of them, and
    # no name that asks what the backend fuses or whether it wrote the cache.
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            names = []
        for name in names:
            assert not name.startswith(_BACKEND_ONLY_MODULES), f"{path.name}:{node.lineno} imports {name}"
        ident = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
        if ident is not None:
            assert not any(w in ident.lower() for w in _BACKEND_ONLY_WORDS), f"{path.name}:{node.lineno} uses {ident}"


def test_qk_transform_describes_exact_modules_only():
    d = 64
    rope, q_norm, k_norm = _rope(d, 32, attention_scaling=0.5), RMSNorm(d, 1e-5), RMSNorm(d, 1e-6)
    qk = qk_transform(rope, q_norm, k_norm, d)
    assert (qk.rotary, qk.q_norm, qk.k_norm) == (rope, q_norm, k_norm)
    assert qk.rope.inv_freq is rope.inv_freq and qk.rope.scaling == 0.5
    assert qk.norm.q_weight is q_norm.weight and qk.norm.k_weight is k_norm.weight
    assert (qk.norm.q_eps, qk.norm.k_eps, qk.norm.gemma) == (1e-5, 1e-6, False)
    assert qk_transform(rope, GemmaRMSNorm(d), GemmaRMSNorm(d), d).norm.gemma
    assert qk_transform(None, None, None, d) == (None, None, None, None, None)
    # What a kernel would compute otherwise, or could not: no description, the modules alone.
    sub = type("OtherNorm", (RMSNorm,), {})
    assert qk_transform(rope, RMSNorm(d), GemmaRMSNorm(d), d).norm is None  # mixed classes
    assert qk_transform(rope, sub(d), sub(d), d).norm is None  # a subclass may weigh otherwise
    assert qk_transform(rope, RMSNorm(32), RMSNorm(32), d).norm is None  # not over whole heads
    assert qk_transform(_rope(d, is_neox_style=False), None, None, d).rope is None  # GPT-J pairs
    assert qk_transform(type("OtherRope", (RotaryEmbedding,), {})(d, rope.inv_freq), None, None, d).rope is None
    assert qk_transform(_rope(128), None, None, d).rope is None  # heads of another size
    assert qk_transform(copy.deepcopy(rope).to(torch.float16), None, None, d).rope is None  # frequencies cast


@pytest.mark.parametrize("backend", ["cpu", "torch_ref"])
@pytest.mark.parametrize("norm_cls", [None, RMSNorm, GemmaRMSNorm], ids=["llama", "qwen3", "gemma3"])
def test_cpu_backends_run_the_modules_as_the_model_would(backend, norm_cls):
    # The CPU backends apply the layer's modules in torch: norms over [T, H, D] heads, then rotary, then
    # attention. The layer's output must be that, to the bit, in a mixed step (a prompt chunk and a decode).
    torch.manual_seed(0)
    hidden, hq, hkv, d, block_size = 96, 4, 2, 32, 16
    layer = LlamaAttention(hidden, hq, hkv, d, _rope(d, 16), get_attn_backend(backend, "cpu"), qk_norm_cls=norm_cls)
    for p in layer.parameters():
        p.data.normal_(0.0 if norm_cls is GemmaRMSNorm or p.dim() > 1 else 1.0, 0.3)
    positions, md = step_metadata([[0, 1], [2]], [3, 6], [5, 1], block_size)
    x = torch.randn(positions.numel(), hidden)
    cache = torch.randn(2, 3, block_size, hkv, d)

    got_cache = cache.clone()
    got = layer(positions, x, got_cache, md)

    q, k, v = layer.qkv_proj.split_qkv(layer.qkv_proj(x))
    q, k, v = q.unflatten(-1, (hq, d)), k.unflatten(-1, (hkv, d)), v.unflatten(-1, (hkv, d))
    if norm_cls is not None:
        q, k = layer.q_norm(q), layer.k_norm(k)
    q, k = layer.rotary_emb(positions, q, k)
    ref_cache = cache.clone()
    out = layer.attn.impl.forward(q, k, v, ref_cache, step_metadata([[0, 1], [2]], [3, 6], [5, 1], block_size)[1])
    expected = layer.o_proj(out.flatten(1))
    assert torch.equal(got, expected)
    assert torch.equal(got_cache, ref_cache)
