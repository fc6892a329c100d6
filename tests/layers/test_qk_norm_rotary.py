"""The fused q/k RMSNorm + neox rotary kernel against the torch path (q_norm/k_norm, RotaryEmbedding), interpreted on CPU."""
from __future__ import annotations

import copy

import pytest
import torch

_ON_GPU = torch.cuda.is_available()  # without a GPU, conftest.py runs the kernels interpreted

triton = pytest.importorskip("triton", reason="triton is not importable; the fused kernels cannot be tested")

from pagedllm.kernels import qk_norm_rotary as qkr_k  # noqa: E402
from pagedllm.attention.backends.triton import TritonImpl  # noqa: E402
from pagedllm.layers.attention import qk_transform  # noqa: E402
from pagedllm.layers.norm import GemmaRMSNorm, RMSNorm  # noqa: E402
from pagedllm.layers.rotary import RotaryEmbedding  # noqa: E402


pytestmark = [pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")]

DEVICE = "cuda" if _ON_GPU else "cpu"
# The interpreter mishandles bfloat16, so that case runs only compiled, on CUDA.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if _ON_GPU else [])
POSITIONS = [0, 1, 17, 255, 1000, 4095, 32767]


def _tol(dtype: torch.dtype) -> dict:
    # float32 differs in summation order and sqrt/sin/cos ulps; half types by about one rounding step.
    return {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}.get(
        dtype, dict(atol=2e-2, rtol=2e-2)
    )


def _assert_matches(got: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(got, ref, **_tol(got.dtype))
    # Checked under the interpreter only: on CUDA the reference modules run their own fused kernels
    # (another op order) and compiled code may contract multiply-adds, so only the tolerance applies.
    if got.dtype != torch.float32 and not got.is_cuda:
        # One skipped or extra rounding (a different op order) stays within a tolerance of one half
        # ulp but changes some 10% of the elements; a faithful order changes only the rare element
        # whose float32 intermediate lands on a rounding boundary (about 0.01% here).
        changed = (got != ref).float().mean().item()
        assert changed <= 0.02, f"{changed:.2%} of the elements differ from the torch path"


def _layers(head_size: int, rotary_dim: int, dtype: torch.dtype, gemma: bool, scaling: float = 1.0, eps: float = 1e-6):
    """q_norm, k_norm and rotary embedding as LlamaAttention builds them, with random norm weights."""
    cls = GemmaRMSNorm if gemma else RMSNorm
    q_norm, k_norm = cls(head_size, eps, params_dtype=dtype), cls(head_size, eps, params_dtype=dtype)
    # Gemma stores w as an offset from 1 (near 0); Llama/Qwen3 weights sit around 1.
    for norm in (q_norm, k_norm):
        norm.weight.data.normal_(0.0 if gemma else 1.0, 0.5)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    rope = RotaryEmbedding(head_size, inv_freq, scaling)
    return q_norm.to(DEVICE), k_norm.to(DEVICE), rope.to(DEVICE)


def _ref(positions, q, k, q_norm, k_norm, rope, head_size):
    """LlamaAttention's torch path on CPU copies (where no CUDA dispatch applies): [T, H, D] each."""
    cpu = [copy.deepcopy(m).cpu() for m in (q_norm, k_norm, rope)]
    q, k = q.detach().cpu().clone(), k.detach().cpu().clone()
    with torch.no_grad():
        q = cpu[0](q.unflatten(-1, (-1, head_size)) if q.dim() == 2 else q)
        k = cpu[1](k.unflatten(-1, (-1, head_size)) if k.dim() == 2 else k)
        q, k = cpu[2](positions.cpu(), q, k)
    return q.to(DEVICE), k.to(DEVICE)


def _usable(positions, q, k, q_norm, k_norm, rope) -> bool:
    """What the Triton backend asks before the fused launch: the modules described as numbers (exact classes
    only), then the kernel's own conditions on the tensors."""
    qk = qk_transform(rope, q_norm, k_norm, rope.head_size)
    return qk.rope is not None and qk.norm is not None and qkr_k.usable(
        positions, q, k, qk.norm.q_weight, qk.norm.k_weight, qk.rope.inv_freq, rope.head_size, True, qk.norm.gemma)


def _apply(positions, q, k, q_norm, k_norm, rope, cache=None):
    """The fused launch from the modules' numbers, as the Triton backend runs it."""
    qk = qk_transform(rope, q_norm, k_norm, rope.head_size)
    norm = qk.norm
    return qkr_k.qk_norm_rotary_(positions, q, k, norm.q_weight, norm.k_weight, norm.q_eps, norm.k_eps,
                                 qk.rope.inv_freq, rope.head_size, qk.rope.scaling, gemma=norm.gemma, cache=cache)


def _check(dtype, head_size, rotary_dim, hq, hkv, gemma, three_d, scaling=1.0, pos_dtype=torch.int64):
    torch.manual_seed(head_size * 7 + hq * 3 + hkv + int(gemma))
    q_norm, k_norm, rope = _layers(head_size, rotary_dim, dtype, gemma, scaling)
    positions = torch.tensor(POSITIONS, dtype=pos_dtype, device=DEVICE)
    tokens = positions.numel()
    # q and k as the strided views of one fused qkv output that LlamaAttention hands over; a row of
    # padding past v makes the token stride differ from every slice's width.
    width = (hq + 2 * hkv) * head_size
    qkv = (3 * torch.randn(tokens, width + 8, dtype=torch.float32, device=DEVICE)).to(dtype)[:, :width]
    q, k = qkv[:, : hq * head_size], qkv[:, hq * head_size : (hq + hkv) * head_size]
    if three_d:
        q, k = q.unflatten(-1, (hq, head_size)), k.unflatten(-1, (hkv, head_size))
    assert not q.is_contiguous() and not k.is_contiguous()
    v_before = qkv[:, (hq + hkv) * head_size :].clone()
    ref_q, ref_k = _ref(positions, q, k, q_norm, k_norm, rope, head_size)

    assert _usable(positions, q, k, q_norm, k_norm, rope)
    got_q, got_k = _apply(positions, q, k, q_norm, k_norm, rope)
    # In place: the same views, rewritten inside the qkv output; v untouched.
    assert got_q is q and got_k is k
    _assert_matches(got_q if three_d else got_q.unflatten(-1, (-1, head_size)), ref_q)
    _assert_matches(got_k if three_d else got_k.unflatten(-1, (-1, head_size)), ref_k)
    torch.testing.assert_close(qkv[:, (hq + hkv) * head_size :], v_before, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gemma", [False, True], ids=["llama_w", "gemma_1pw"])
@pytest.mark.parametrize(
    "head_size,hq,hkv,three_d",
    # GQA 2:1 and 8:1 (more q heads than one tile holds at D=64), MHA, and MQA.
    [(64, 4, 2, False), (64, 24, 3, True), (128, 5, 5, False), (128, 16, 2, True), (256, 4, 1, False)],
)
def test_matches_torch_path(dtype, gemma, head_size, hq, hkv, three_d):
    _check(dtype, head_size, head_size, hq, hkv, gemma, three_d)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gemma", [False, True], ids=["llama_w", "gemma_1pw"])
def test_partial_rotary(dtype, gemma):
    """Channels past rotary_dim are normalized with the rest of the head but not rotated."""
    _check(dtype, 128, 64, 4, 2, gemma, False)
    _check(dtype, 80, 40, 3, 1, gemma, True)  # neither half nor the rest a power of two


def test_attention_scaling_and_int32_positions():
    _check(torch.float16, 64, 64, 4, 2, False, False, scaling=0.75, pos_dtype=torch.int32)


def test_not_usable_cases():
    """Cases the kernel does not compute like the torch path: the caller must fall back."""
    head_size = 64
    q_norm, k_norm, rope = _layers(head_size, head_size, torch.float16, False)
    positions = torch.arange(3, device=DEVICE)
    qkv = torch.randn(3, 4 * head_size, dtype=torch.float16, device=DEVICE)
    q, k = qkv[:, : 2 * head_size], qkv[:, 2 * head_size : 3 * head_size]
    assert _usable(positions, q, k, q_norm, k_norm, rope)
    # A Llama-style weight of another dtype makes torch type-promote the product.
    assert not _usable(positions, q, k, copy.deepcopy(q_norm).float(), k_norm, rope)
    # A Gemma weight is cast to float32 anyway, so its dtype does not matter.
    g_q, g_k, _ = _layers(head_size, head_size, torch.float32, True)
    assert _usable(positions, q, k, g_q, g_k, rope)
    # Mixed norm classes, GPT-J style rotary, a norm of another width, a strided head dim, float positions.
    assert not _usable(positions, q, k, q_norm, g_k, rope)
    gptj = RotaryEmbedding(head_size, rope.inv_freq.cpu(), is_neox_style=False).to(DEVICE)
    assert not _usable(positions, q, k, q_norm, k_norm, gptj)
    assert not _usable(positions, q, k, RMSNorm(32, params_dtype=torch.float16).to(DEVICE), k_norm, rope)
    assert not _usable(positions, q[:, ::2], k[:, ::2], q_norm, k_norm, rope)
    assert not _usable(positions.float(), q, k, q_norm, k_norm, rope)
    assert not _usable(positions[:0], q[:0], k[:0], q_norm, k_norm, rope)
    # A subclass might apply its weight differently: only the exact classes are recognized.
    sub = type("OtherNorm", (RMSNorm,), {})
    assert not _usable(positions, q, k, sub(head_size, params_dtype=torch.float16).to(DEVICE),
                                    sub(head_size, params_dtype=torch.float16).to(DEVICE), rope)


@pytest.mark.parametrize("step", ["prompt", "decode"])
@pytest.mark.parametrize("gemma", [False, True], ids=["llama_w", "gemma_1pw"])
def test_triton_backend_applies_the_layers_modules(gemma, step):
    """TritonImpl.forward_qk given a layer's q/k norms and rotary embedding (what LlamaAttention hands the
    Attention layer): the fused launch normalises and rotates q and k in place in the qkv output and stores
    the keys and values, and attention gives what it gives after the modules; a norm the backend cannot
    know exactly (a subclass) runs as a module, with the modules' result to the bit."""
    from paged_batches import step_metadata

    torch.manual_seed(3)
    dtype, hq, hkv, d, block_size = torch.float32, 4, 2, 64, 16
    q_norm, k_norm, rope = _layers(d, d, dtype, gemma)
    starts, lens = ([0, 5], [7, 3]) if step == "prompt" else ([9, 30, 2], [1, 1, 1])
    tables = [[2 * i, 2 * i + 1, 2 * i + 6] for i in range(len(starts))]
    positions, md = step_metadata(tables, starts, lens, block_size, DEVICE)
    tokens = positions.numel()
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, dtype=dtype, device=DEVICE)
    cache = torch.randn(2, 12, block_size, hkv, d, dtype=dtype, device=DEVICE)
    impl = TritonImpl(hq, d, d**-0.5, hkv)

    def heads(t):  # q, k, v as the Attention layer hands them over: [T, H, D] views of the qkv output
        return (t[:, : hq * d].view(tokens, hq, d), t[:, hq * d : (hq + hkv) * d].view(tokens, hkv, d),
                t[:, (hq + hkv) * d :].view(tokens, hkv, d))

    ref_cache = cache.clone()
    q, k, v = heads(qkv.clone())
    ref_q, ref_k = rope(positions, q_norm(q), k_norm(k))
    expected = impl.forward(ref_q, ref_k, v, ref_cache, md)

    got_cache = cache.clone()
    q, k, v = heads(qkv.clone())
    out = impl.forward_qk(positions, q, k, v, got_cache, md, qk_transform(rope, q_norm, k_norm, d))
    _assert_matches(q, ref_q)  # rewritten in place: the fused launch ran
    _assert_matches(k, ref_k)
    torch.testing.assert_close(out, expected, **_tol(dtype))
    torch.testing.assert_close(got_cache, ref_cache, **_tol(dtype))

    sub = type("OtherNorm", (GemmaRMSNorm if gemma else RMSNorm,), {})
    other_q, other_k = sub(d, params_dtype=dtype).to(DEVICE), sub(d, params_dtype=dtype).to(DEVICE)
    other_q.load_state_dict(q_norm.state_dict())
    other_k.load_state_dict(k_norm.state_dict())
    got_cache = cache.clone()
    q, k, v = heads(qkv.clone())
    out = impl.forward_qk(positions, q, k, v, got_cache, md, qk_transform(rope, other_q, other_k, d))
    assert torch.equal(q, heads(qkv)[0]), "a module the backend cannot describe runs as a module, out of place"
    assert torch.equal(out, expected) and torch.equal(got_cache, ref_cache)


CACHE_CASES = [
    # (activation dtype, cache dtype, head size, rotary dim, q heads, kv heads, values as [T, H, D])
    (torch.float16, torch.float16, 64, 64, 4, 2, False),
    (torch.float32, torch.float16, 128, 128, 16, 2, True),  # a narrower cache, as float32 compute keeps
    (torch.float16, torch.float8_e4m3fn, 64, 64, 8, 1, False),
    (torch.float16, torch.float16, 80, 40, 3, 1, True),  # partial rotary: the pass-through channels too
] + ([(torch.bfloat16, torch.bfloat16, 128, 128, 16, 8, False)] if _ON_GPU else [])


@pytest.mark.parametrize("dtype,cache_dtype,head_size,rotary_dim,hq,hkv,three_d", CACHE_CASES)
@pytest.mark.parametrize("gemma", [False, True], ids=["llama_w", "gemma_1pw"])
def test_cache_write_equals_reshape_and_cache(dtype, cache_dtype, head_size, rotary_dim, hq, hkv, three_d, gemma):
    """With ``cache``, the launch stores the finished keys and the values at their slots: the same cache
    bytes as the kernel without it followed by reshape_and_cache, the same q and k, padding slots untouched."""
    from pagedllm.kernels.attention.reshape_and_cache import reshape_and_cache

    torch.manual_seed(hq * 11 + hkv + head_size)
    q_norm, k_norm, rope = _layers(head_size, rotary_dim, dtype, gemma)
    positions = torch.tensor(POSITIONS, dtype=torch.int64, device=DEVICE)
    tokens, block_size, num_blocks = positions.numel(), 4, 5
    width = (hq + 2 * hkv) * head_size
    qkv = (3 * torch.randn(tokens, width + 8, dtype=torch.float32, device=DEVICE)).to(dtype)[:, :width]
    # Scattered slots over several blocks, and two padding tokens (-1) that own none.
    slots = torch.tensor([13, 2, -1, 7, 19, -1, 0], dtype=torch.int64, device=DEVICE)
    views = []
    for _ in range(2):
        t = qkv.clone()
        q, k, v = t[:, : hq * head_size], t[:, hq * head_size : (hq + hkv) * head_size], t[:, (hq + hkv) * head_size :]
        if three_d:
            q, k, v = (x.unflatten(-1, (-1, head_size)) for x in (q, k, v))
        views.append((t, q, k, v))
    fill = torch.randn(2, num_blocks, block_size, hkv, head_size, device=DEVICE).to(cache_dtype)
    ref_cache, got_cache = fill.clone(), fill.clone()

    (ref_t, q, k, v), (got_t, gq, gk, gv) = views
    _apply(positions, q, k, q_norm, k_norm, rope)
    flat = lambda x: x if x.dim() == 3 else x.unflatten(-1, (-1, head_size))  # noqa: E731
    reshape_and_cache(flat(k), flat(v), ref_cache[0], ref_cache[1], slots)

    write = qkr_k.KVCacheWrite(gv, got_cache[0], got_cache[1], slots)
    assert qkr_k.cache_write_usable(write, gk, head_size)
    _apply(positions, gq, gk, q_norm, k_norm, rope, write)
    assert torch.equal(got_t, ref_t), "q, k and v must come out as without the cache write"
    assert torch.equal(got_cache.view(torch.uint8), ref_cache.view(torch.uint8))
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool, device=DEVICE)
    written[slots[slots >= 0]] = True
    untouched = got_cache.flatten(1, 2)[:, ~written]
    assert torch.equal(untouched.view(torch.uint8), fill.flatten(1, 2)[:, ~written].view(torch.uint8))


def test_cache_write_not_usable_cases():
    head_size = 64
    k = torch.zeros(3, 2 * head_size, dtype=torch.float16, device=DEVICE)
    cache = torch.zeros(2, 4, 16, 2, head_size, dtype=torch.float16, device=DEVICE)
    slots = torch.arange(3, device=DEVICE)
    ok = qkr_k.KVCacheWrite(k.clone(), cache[0], cache[1], slots)
    assert qkr_k.cache_write_usable(ok, k, head_size)
    bad = [
        ok._replace(slot_mapping=slots.int()),  # int32 slots
        ok._replace(slot_mapping=slots[:2]),  # fewer slots than tokens
        ok._replace(value=k[:, :head_size]),  # one value head for two key heads
        ok._replace(v_cache=cache[1].transpose(1, 2)),  # another layout than the key cache
        ok._replace(k_cache=cache[0][..., :32], v_cache=cache[1][..., :32]),  # another head size
    ]
    for write in bad:
        assert not qkr_k.cache_write_usable(write, k, head_size)
