"""The CPU attention backend against the torch_ref oracle: prefill with and without a cached prefix,
decode, mixed and ragged batches, GQA/MQA, sliding windows, soft caps, padding rows, plan reuse.

Float32 tolerance: atol = rtol = 1e-5. Both compute softmax attention in float32 from the same
inputs; they differ only in summation order and in where the scale is applied (~1e-7 relative).
"""
from __future__ import annotations


import pytest
import torch
from paged_batches import build_paged_batch

from pagedllm.attention.backends import cpu as cpu_backend
from pagedllm.attention.backends.torch_ref import TorchRefImpl
from pagedllm.attention.registry import get_attn_backend


_TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}


def _check(reqs, num_heads, num_kv_heads, head_size, block_size, *, window=None, soft_cap=None, pad=0,
           dtype=torch.float32, seed=0):
    query, key, value, kv_cache, poisoned, metadata = build_paged_batch(
        reqs, num_heads, num_kv_heads, head_size, block_size, dtype, seed, pad
    )
    scale = head_size**-0.5
    expected = TorchRefImpl(num_heads, head_size, scale, num_kv_heads, window, soft_cap).forward(
        query, key, value, kv_cache, metadata()
    )
    impl = cpu_backend.CpuAttentionImpl(num_heads, head_size, scale, num_kv_heads, window, soft_cap)
    out = impl.forward(query, key, value, poisoned, metadata())

    assert out.shape == expected.shape and out.dtype == expected.dtype
    torch.testing.assert_close(out, expected, **_TOL[dtype])
    assert torch.count_nonzero(out[expected.shape[0] - pad :]) == 0, "padding rows must stay zero"
    written = metadata().slot_mapping
    written = written[written >= 0]
    for kv in range(2):
        flat_ref = kv_cache[kv].view(-1, num_kv_heads, head_size)
        flat_out = poisoned[kv].view(-1, num_kv_heads, head_size)
        assert torch.equal(flat_out[written], flat_ref[written])


CASES = [
    # reqs (cached context, new tokens), Hq, Hkv, D, block_size, window, soft_cap, pad
    pytest.param([(0, 19), (0, 5)], 4, 1, 64, 16, None, None, 0, id="prefill-noprefix-mqa"),
    pytest.param([(37, 12), (16, 20), (0, 9)], 4, 4, 32, 16, None, None, 0, id="prefill-prefix-mha"),
    pytest.param([(40, 1), (0, 1), (95, 1), (17, 1)], 8, 2, 64, 16, None, None, 0, id="decode-gqa4"),
    pytest.param([(300, 1), (3, 1), (129, 1)], 4, 1, 256, 16, None, None, 0, id="decode-ragged-d256"),
    pytest.param([(0, 7), (50, 1), (20, 13), (9, 1), (64, 1)], 8, 2, 48, 16, None, None, 3, id="mixed-pad"),
    pytest.param([(30, 9), (45, 1), (0, 14), (3, 1)], 4, 2, 32, 32, 10, None, 0, id="mixed-window"),
    pytest.param([(80, 1), (5, 1), (33, 1)], 4, 1, 32, 16, 24, None, 0, id="decode-window"),
    pytest.param([(0, 70), (61, 40)], 4, 1, 32, 16, 17, None, 0, id="prefill-window-long"),
    pytest.param([(25, 6), (33, 1)], 6, 2, 96, 16, None, 15.0, 0, id="softcap-gqa3"),
    pytest.param([(90, 1), (60, 11), (0, 3)], 8, 1, 64, 32, 20, 10.0, 2, id="mixed-window-softcap-pad"),
    pytest.param([(0, 1), (7, 1)], 2, 2, 16, 16, None, None, 0, id="decode-one-token-sequence"),
]


@pytest.mark.parametrize("reqs,num_heads,num_kv_heads,head_size,block_size,window,soft_cap,pad", CASES)
def test_cpu_matches_torch_ref(reqs, num_heads, num_kv_heads, head_size, block_size, window, soft_cap, pad):
    _check(reqs, num_heads, num_kv_heads, head_size, block_size, window=window, soft_cap=soft_cap, pad=pad,
           seed=len(reqs) * 31 + head_size)


def test_cpu_fp16_matches_torch_ref():
    _check([(17, 3), (30, 1), (0, 7)], 4, 2, 32, 16, window=9, soft_cap=20.0, dtype=torch.float16, seed=5)


def test_prefill_tiles(monkeypatch):
    # Chunks longer than a query tile, with and without a prefix and a window that cuts tiles' keys.
    monkeypatch.setattr(cpu_backend, "_PREFILL_TILE", 16)
    _check([(0, 53), (21, 40), (5, 1)], 4, 2, 32, 16, seed=11)
    _check([(0, 53), (21, 40), (5, 1)], 4, 2, 32, 16, window=12, seed=12)


def test_plan_shared_by_layers_of_one_step():
    # Two layers (local and global) on one metadata object: one plan, one decode group per window,
    # and each layer's result still equals the reference's.
    reqs = [(40, 1), (12, 1), (0, 6)]
    query, key, value, kv_cache, poisoned, metadata = build_paged_batch(reqs, 4, 1, 32, 16, torch.float32, seed=3)
    md = metadata()
    for window in (8, None, 8):
        ref = TorchRefImpl(4, 32, 0.2, 1, window).forward(query, key, value, kv_cache, metadata())
        out = cpu_backend.CpuAttentionImpl(4, 32, 0.2, 1, window).forward(query, key, value, poisoned, md)
        torch.testing.assert_close(out, ref, **_TOL[torch.float32])
    (plan,) = md.step_cache.values()
    assert set(plan.decode) == {8, None} and set(plan.prefill) == {8, None}


def test_many_decodes():
    reqs = [(1 + (7 * i) % 45, 1) for i in range(70)]
    _check(reqs, 2, 1, 8, 16, seed=7)


def test_registry_picks_cpu_backend_on_cpu():
    assert get_attn_backend(None, "cpu") is cpu_backend.CpuAttentionBackend
    assert get_attn_backend("torch_ref", "cpu").name == "torch_ref"
