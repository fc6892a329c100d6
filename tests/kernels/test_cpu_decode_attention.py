"""The C decode attention kernel against softmax(q k^T) v in float64 over the same paged slots: GQA, soft cap,
requests that see fewer keys than the batch's widest, odd head sizes, threads; bad slots refused by name."""
from __future__ import annotations

import pytest
import torch

from pagedllm.kernels.cpu import decode_attention as da

pytestmark = pytest.mark.skipif(not da.available(), reason="the CPU decode attention kernel cannot run here")


def _reference(query, k_flat, v_flat, slots, counts, scale, cap):  # -> [B, Hq, D] float64
    b, hq, d = query.shape
    g = hq // k_flat.shape[1]
    out = torch.zeros(b, hq, d, dtype=torch.float64)
    for r in range(b):
        visible = slots[r, : counts[r]]
        for h in range(hq):
            k = k_flat[visible, h // g].double()  # [n, D]
            v = v_flat[visible, h // g].double()
            s = scale * (k @ query[r, h].double())
            if cap:
                s = cap * torch.tanh(s / cap)
            out[r, h] = torch.softmax(s, 0) @ v
    return out


@pytest.mark.parametrize(("b", "hq", "hkv", "d", "cap", "threads"), [
    (1, 4, 1, 256, None, 1),  # Gemma 3 270M's decode step
    (3, 8, 2, 64, None, 2),
    (5, 6, 3, 20, 30.0, 2),  # a head size that is not a multiple of 8, soft cap
    (2, 2, 2, 7, None, 1),
])
def test_matches_float64_softmax(b, hq, hkv, d, cap, threads) -> None:
    g = torch.Generator().manual_seed(b * 100 + d)
    num_slots, s = 97, 23
    k_flat = torch.randn(num_slots, hkv, d, generator=g)
    v_flat = torch.randn(num_slots, hkv, d, generator=g)
    query = torch.randn(b, hq, d, generator=g) * 2
    slots = torch.randint(0, num_slots, (b, s), generator=g)
    counts = torch.randint(1, s + 1, (b,), generator=g)
    counts[0] = s
    scale = d ** -0.5
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = da.decode_attention(query, k_flat, v_flat, slots, counts, scale, cap)
    finally:
        torch.set_num_threads(before)
    want = _reference(query, k_flat, v_flat, slots, counts, scale, cap)
    assert got.dtype == torch.float32 and got.shape == (b, hq, d)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_keys_past_the_count_are_not_read() -> None:
    k_flat, v_flat = torch.randn(10, 1, 8), torch.randn(10, 1, 8)
    k_flat[9], v_flat[9] = float("nan"), float("nan")  # never written
    slots = torch.tensor([[0, 1, 9]])
    out = da.decode_attention(torch.randn(1, 2, 8), k_flat, v_flat, slots, torch.tensor([2]), 0.3)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize(("slots", "counts"), [([[0, 10]], [2]), ([[0, -1]], [2]), ([[0, 1]], [3]), ([[0, 1]], [0])])
def test_bad_slots_or_counts_are_refused(slots, counts) -> None:
    k = torch.zeros(10, 1, 8)
    with pytest.raises(ValueError, match="request 0 has count"):
        da.decode_attention(torch.zeros(1, 1, 8), k, k, torch.tensor(slots), torch.tensor(counts), 1.0)


def test_write_kv_equals_the_torch_path_and_skips_padding() -> None:
    from pagedllm.attention.backends.torch_ref import write_kv_cache

    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(5, 4 + 2 * 2, 16, generator=g)  # [T, Hq + 2 Hkv, D]: k and v are strided views
    key, value = qkv[:, 4:6], qkv[:, 6:8]
    slots = torch.tensor([7, -1, 0, 12, 3])
    ours, theirs = torch.zeros(2, 4, 4, 2, 16), torch.zeros(2, 4, 4, 2, 16)
    assert da.write_kv_if_usable(key, value, ours[0].view(-1, 2, 16), ours[1].view(-1, 2, 16), slots)
    write_kv_cache(key, value, theirs, slots)
    assert torch.equal(ours, theirs)
    # Tensors it does not take are left to the caller, untouched.
    assert not da.write_kv_if_usable(key.half(), value.half(), ours[0].view(-1, 2, 16), ours[1].view(-1, 2, 16), slots)
    with pytest.raises(ValueError, match=r"slot_mapping\[1\] = 16 is outside the cache's 16 slots"):
        da.write_kv_if_usable(key[:2], value[:2], ours[0].view(-1, 2, 16), ours[1].view(-1, 2, 16), torch.tensor([0, 16]))
