"""The C RMSNorm and rotary kernels against the layers' torch arithmetic: equal bit for bit, odd sizes, strided views."""
from __future__ import annotations

import pytest
import torch

from pagedllm.kernels.cpu import norm_rope
from pagedllm.layers.norm import GemmaRMSNorm, RMSNorm
from pagedllm.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.skipif(not norm_rope.available(), reason="the CPU norm/rotary kernels cannot run here")


def _norm_module(kind: type[RMSNorm], n: int, seed: int) -> RMSNorm:
    module = kind(n, eps=1e-6, params_dtype=torch.float32)
    module.weight.data.copy_(torch.randn(n, generator=torch.Generator().manual_seed(seed)))
    return module


def _torch_norm(module: RMSNorm, x: torch.Tensor) -> torch.Tensor:  # the layer's own torch path
    return module._apply_weight(module._normalize(x.float()), x.dtype)


@pytest.mark.parametrize("kind", [RMSNorm, GemmaRMSNorm])
@pytest.mark.parametrize("rows, n", [(1, 1), (3, 7), (2, 33), (5, 257), (1, 640), (70, 640), (4, 1000), (2, 4097)])
def test_rms_norm_equals_torch(kind, rows, n) -> None:
    g = torch.Generator().manual_seed(rows * 10_000 + n)
    x, res = torch.randn(rows, n, generator=g) * 3, torch.randn(rows, n, generator=g)
    module = _norm_module(kind, n, n)
    gemma = kind is GemmaRMSNorm
    assert torch.equal(norm_rope.rms_norm(x, module.weight, module.eps, gemma=gemma), _torch_norm(module, x))
    x_before, res_before = x.clone(), res.clone()
    out, new_res = norm_rope.rms_norm(x, module.weight, module.eps, res, gemma=gemma)
    assert torch.equal(new_res, x + res) and torch.equal(out, _torch_norm(module, x + res))
    assert torch.equal(x, x_before) and torch.equal(res, res_before)  # inputs are not written
    # The module takes the kernel on these tensors and answers as its torch path does.
    with torch.inference_mode():
        got, got_res = module(x, res)
    assert torch.equal(got, out) and torch.equal(got_res, new_res)


def test_rms_norm_many_rows_on_threads() -> None:
    """Enough rows to be split between threads (PARALLEL_ROWS): each row is still computed alone."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        x = torch.randn(300, 96)
        module = _norm_module(GemmaRMSNorm, 96, 1)
        assert torch.equal(norm_rope.rms_norm(x, module.weight, module.eps, gemma=True), _torch_norm(module, x))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("tokens", [1, 3, 65])
def test_per_head_norm_of_a_strided_view(tokens) -> None:
    """q and k norms read [T, heads, D] views of the fused qkv output; the output is dense."""
    heads, d = 4, 256
    qkv = torch.randn(tokens, (heads + 2) * d)
    q = qkv[:, : heads * d].view(tokens, heads, d)
    module = _norm_module(GemmaRMSNorm, d, 3)
    out = norm_rope.rms_norm(q, module.weight, module.eps, gemma=True)
    assert out.is_contiguous() and torch.equal(out, _torch_norm(module, q))


def test_other_tensors_take_the_torch_path() -> None:
    module = _norm_module(RMSNorm, 16, 4)
    x64 = torch.randn(2, 16, dtype=torch.float64)
    assert not norm_rope.usable_norm(x64, module.weight, None)
    assert norm_rope.rms_norm_if_usable(x64, module.weight, 1e-6) is None
    assert torch.equal(module(x64), _torch_norm(module, x64))
    with pytest.raises(ValueError, match=r"x: torch.float64 \(2, 16\)"):
        norm_rope.rms_norm(x64, module.weight, 1e-6)
    with pytest.raises(ValueError, match="residual"):
        norm_rope.rms_norm(torch.randn(2, 16), module.weight, 1e-6, residual=torch.randn(3, 16))


def _rope(head: int, rotary_dim: int, neox: bool) -> RotaryEmbedding:
    inv_freq = 1.0 / (10_000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    return RotaryEmbedding(head, inv_freq, attention_scaling=1.0, is_neox_style=neox)


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("head, rotary_dim, tokens", [(256, 256, 1), (64, 32, 5), (10, 6, 3), (128, 128, 70)])
def test_rotary_equals_torch(neox, head, rotary_dim, tokens) -> None:
    rope = _rope(head, rotary_dim, neox)
    hq, hkv = 4, 2
    g = torch.Generator().manual_seed(head + tokens)
    qkv = torch.randn(tokens, (hq + 2 * hkv) * head, generator=g) * 4
    q, k = qkv[:, : hq * head], qkv[:, hq * head : (hq + hkv) * head]  # strided 2-D views, as the layers pass
    positions = torch.randint(0, 4096, (tokens,), generator=g)
    cos, sin = rope.cos_sin(positions, torch.float32)
    want_q = rope._rotate(q.view(tokens, hq, head), cos.unsqueeze(1), sin.unsqueeze(1)).reshape(tokens, -1)
    want_k = rope._rotate(k.view(tokens, hkv, head), cos.unsqueeze(1), sin.unsqueeze(1)).reshape(tokens, -1)
    v_before = qkv[:, (hq + hkv) * head :].clone()
    got_q, got_k = rope(positions, q, k)  # the module takes the kernel: in place
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert torch.equal(qkv[:, (hq + hkv) * head :], v_before)  # v, beside them, untouched
    # 3-D [T, heads, D] views, through the kernel's own entry point.
    q3 = torch.randn(tokens, hq, head, generator=g)
    want = rope._rotate(q3, cos.unsqueeze(1), sin.unsqueeze(1))
    assert torch.equal(norm_rope.rotary_(q3, cos, sin, head, neox), want)


def test_rotary_refuses_bad_angles() -> None:
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="cos: torch.float32 \\(3, 2\\)"):
        norm_rope.rotary_(x, torch.ones(3, 2), torch.ones(2, 2), 8, True)
    with pytest.raises(ValueError, match="head_size=8"):
        norm_rope.rotary_(x, torch.ones(2, 5), torch.ones(2, 5), 8, True)
    assert not norm_rope.rotary_pair_if_usable(x.double(), x.double(), torch.ones(2, 2), torch.ones(2, 2), 8, True)
