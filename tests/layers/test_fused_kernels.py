"""The fused RMSNorm, gated-activation and rotary Triton kernels against the torch layers; on CPU they run in Triton's interpreter."""
from __future__ import annotations

import copy

import pytest
import torch

_ON_GPU = torch.cuda.is_available()  # without a GPU, conftest.py runs the kernels interpreted

triton = pytest.importorskip("triton", reason="triton is not importable; the fused kernels cannot be tested")

from pagedllm.layers.activation import GeluAndMul, SiluAndMul  # noqa: E402
from pagedllm.kernels import activation as act_k  # noqa: E402
from pagedllm.kernels import rmsnorm as norm_k  # noqa: E402
from pagedllm.kernels import rotary as rot_k  # noqa: E402
from pagedllm.layers.norm import GemmaRMSNorm, RMSNorm  # noqa: E402
from pagedllm.layers.rotary import RotaryEmbedding  # noqa: E402


pytestmark = [
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning"),
    # tanh GELU's exp(2y) overflows to inf on purpose for large |y| (the formula's limit is then exact).
    pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning"),
]

DEVICE = "cuda" if _ON_GPU else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if _ON_GPU else [])


def _tol(dtype: torch.dtype) -> dict:
    # float32 differs only in summation order and sqrt/exp ulps; half types by about one rounding step.
    return {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}.get(
        dtype, dict(atol=2e-2, rtol=2e-2)
    )


def _ref(module: torch.nn.Module, *args):
    """The layer's torch path, the reference: run on CPU copies, where the CUDA dispatch does not apply."""
    cpu_args = [a.detach().cpu().clone() if isinstance(a, torch.Tensor) else a for a in args]
    with torch.no_grad():
        out = copy.deepcopy(module).cpu()(*cpu_args)
    return tuple(o.to(DEVICE) for o in out) if isinstance(out, tuple) else out.to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 1000, 4099])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("gemma", [False, True])
def test_rmsnorm(dtype, hidden, with_residual, gemma):
    torch.manual_seed(hidden)
    layer = (GemmaRMSNorm if gemma else RMSNorm)(hidden, eps=1e-5, params_dtype=dtype).to(DEVICE)
    layer.weight.data.normal_(0.0, 0.5 if gemma else 1.0)
    x = torch.randn(5, hidden, dtype=dtype, device=DEVICE)
    res = torch.randn(5, hidden, dtype=dtype, device=DEVICE) if with_residual else None
    assert norm_k.usable(x, layer.weight, res)
    # On CPU the layer itself is the torch reference (its CUDA dispatch does not apply).
    ref = _ref(layer, x, res) if res is not None else (_ref(layer, x),)
    got = norm_k.rms_norm(x, layer.weight, layer.eps, res, gemma=gemma)
    got = got if res is not None else (got,)
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, **_tol(dtype))


def test_rmsnorm_strided_heads():
    """q/k norm: [T, H, D] views into a fused qkv row, normalized per head."""
    torch.manual_seed(0)
    layer = RMSNorm(48, eps=1e-6).to(DEVICE)
    layer.weight.data.normal_()
    qkv = torch.randn(3, 7 * 48 + 16, device=DEVICE)
    q = qkv[:, : 4 * 48].unflatten(-1, (4, 48))
    assert norm_k.usable(q, layer.weight)
    torch.testing.assert_close(norm_k.rms_norm(q, layer.weight, layer.eps), _ref(layer, q), **_tol(torch.float32))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ["silu", "gelu_tanh", "gelu"])
@pytest.mark.parametrize("n_cols", [7, 1100])
def test_act_and_mul(dtype, act, n_cols):
    torch.manual_seed(n_cols)
    module = SiluAndMul() if act == "silu" else GeluAndMul("tanh" if act == "gelu_tanh" else "none")
    x = 3 * torch.randn(4, 2 * n_cols, dtype=dtype, device=DEVICE)
    assert act_k.usable(x)
    torch.testing.assert_close(act_k.act_and_mul(x, act), _ref(module, x), **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "head_size,rotary_dim,hq,hkv,three_d,scaling",
    [(64, 64, 4, 2, False, 1.0), (80, 40, 3, 1, True, 1.0), (128, 128, 5, 5, False, 0.75)],
)
def test_rotary_in_place(dtype, head_size, rotary_dim, hq, hkv, three_d, scaling):
    torch.manual_seed(head_size)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    rope = RotaryEmbedding(head_size, inv_freq, scaling).to(DEVICE)
    tokens = 6
    positions = torch.tensor([0, 1, 17, 255, 1000, 4095], device=DEVICE)
    # q and k as views of one fused qkv row, as the attention layer hands them over.
    qkv = torch.randn(tokens, (hq + 2 * hkv) * head_size, dtype=dtype, device=DEVICE)
    q, k = qkv[:, : hq * head_size], qkv[:, hq * head_size : (hq + hkv) * head_size]
    if three_d:
        q, k = q.unflatten(-1, (hq, head_size)), k.unflatten(-1, (hkv, head_size))
    v_before = qkv[:, (hq + hkv) * head_size :].clone()
    ref_q, ref_k = _ref(rope, positions, q, k)
    assert rot_k.usable(q, k, positions, head_size, True)
    got_q, got_k = rot_k.rotary_neox_(positions, q, k, rope.inv_freq, head_size, scaling)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()
    torch.testing.assert_close(got_q, ref_q, **_tol(dtype))
    torch.testing.assert_close(got_k, ref_k, **_tol(dtype))
    torch.testing.assert_close(qkv[:, (hq + hkv) * head_size :], v_before, atol=0, rtol=0)
