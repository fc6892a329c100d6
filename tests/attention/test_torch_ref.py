"""torch_ref (the kernels' oracle) checked against naive dense causal attention over shuffled block tables."""
from __future__ import annotations

import math

import pytest
import torch

from pagedllm.attention.backends.torch_ref import TorchRefImpl
from pagedllm.attention.metadata import AttentionMetadata


def _build(reqs, num_heads, num_kv_heads, head_size, block_size, dtype, seed, pad=0):
    """A paged batch plus the dense per-request K/V it encodes.

    ``reqs`` holds (cached context length, new query length) per request. Physical blocks are a random
    permutation, so any bug that assumes contiguous blocks shows up.
    """
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in reqs]
    blocks_per_req = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 2
    perm = torch.randperm(num_blocks, generator=gen)
    block_table = torch.zeros(len(reqs), max(blocks_per_req) + 1, dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_per_req):
        block_table[i, :n] = perm[used : used + n]
        used += n

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    kv_cache = rnd(2, num_blocks, block_size, num_kv_heads, head_size)
    dense_k = [rnd(s, num_kv_heads, head_size) for s in seq_lens]
    dense_v = [rnd(s, num_kv_heads, head_size) for s in seq_lens]
    queries, keys, values, slots, qsl = [], [], [], [], [0]
    for i, (ctx, q_len) in enumerate(reqs):
        pos = torch.arange(seq_lens[i])
        slot = block_table[i, pos // block_size].long() * block_size + pos % block_size
        # The cached prefix is already in place; the new tokens arrive through forward().
        kv_cache[0].view(-1, num_kv_heads, head_size)[slot[:ctx]] = dense_k[i][:ctx]
        kv_cache[1].view(-1, num_kv_heads, head_size)[slot[:ctx]] = dense_v[i][:ctx]
        queries.append(rnd(q_len, num_heads, head_size))
        keys.append(dense_k[i][ctx:])
        values.append(dense_v[i][ctx:])
        slots.append(slot[ctx:])
        qsl.append(qsl[-1] + q_len)
    num_tokens = qsl[-1]
    query = torch.cat(queries + [rnd(pad, num_heads, head_size)])
    key = torch.cat(keys + [rnd(pad, num_kv_heads, head_size)])
    value = torch.cat(values + [rnd(pad, num_kv_heads, head_size)])
    slot_mapping = torch.cat(slots + [torch.full((pad,), -1, dtype=torch.long)])
    md = AttentionMetadata(
        num_actual_tokens=num_tokens,
        num_reqs=len(reqs),
        max_query_len=max(q for _, q in reqs),
        max_seq_len=max(seq_lens),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=block_table,
        slot_mapping=slot_mapping,
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
    )
    return query, key, value, kv_cache, md, dense_k, dense_v


def _dense_attention(q, k, v, scale, window, soft_cap):
    """Per-head loops in float64 over the whole sequence; q holds the last q.shape[0] positions."""
    q_len, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    out = torch.empty(q_len, num_heads, q.shape[-1], dtype=torch.float64)
    q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
    k_pos = torch.arange(seq_len)[None, :]
    visible = k_pos <= q_pos
    if window is not None:
        visible &= k_pos > q_pos - window
    for h in range(num_heads):
        kh, vh = k[:, h // group].double(), v[:, h // group].double()
        scores = q[:, h].double() @ kh.T * scale
        if soft_cap is not None:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        scores = scores.masked_fill(~visible, float("-inf"))
        out[:, h] = torch.softmax(scores, dim=-1) @ vh
    return out


CASES = [
    # reqs, Hq, Hkv, D, block_size, window, soft_cap, dtype
    pytest.param([(0, 9), (0, 3)], 4, 4, 16, 16, None, None, torch.float32, id="prefill-mha"),
    pytest.param([(37, 6), (16, 16), (0, 1)], 8, 2, 32, 16, None, None, torch.float32, id="prefix-gqa4"),
    pytest.param([(5, 1), (70, 1), (33, 1)], 8, 1, 16, 32, None, None, torch.float32, id="decode-mqa"),
    pytest.param([(0, 11), (40, 1), (19, 5), (3, 1)], 4, 2, 16, 16, 6, None, torch.float32, id="mixed-window"),
    pytest.param([(21, 4), (50, 1)], 4, 1, 24, 32, None, 5.0, torch.float32, id="mixed-softcap"),
    pytest.param([(17, 3), (30, 1), (0, 7)], 4, 2, 32, 16, 9, 20.0, torch.float16, id="fp16-all"),
]


@pytest.mark.parametrize("reqs,num_heads,num_kv_heads,head_size,block_size,window,soft_cap,dtype", CASES)
def test_torch_ref_matches_dense(reqs, num_heads, num_kv_heads, head_size, block_size, window, soft_cap, dtype):
    query, key, value, kv_cache, md, dense_k, dense_v = _build(
        reqs, num_heads, num_kv_heads, head_size, block_size, dtype, seed=len(reqs) * 101 + head_size, pad=2
    )
    scale = head_size**-0.5
    impl = TorchRefImpl(num_heads, head_size, scale, num_kv_heads, window, soft_cap)
    out = impl.forward(query, key, value, kv_cache, md)

    tol = 1e-5 if dtype == torch.float32 else 2e-3
    qsl = md.query_start_loc_cpu
    for i in range(md.num_reqs):
        expected = _dense_attention(query[qsl[i] : qsl[i + 1]], dense_k[i], dense_v[i], scale, window, soft_cap)
        torch.testing.assert_close(out[qsl[i] : qsl[i + 1]].double(), expected, atol=tol, rtol=tol)
        # The paged cache now holds the request's whole sequence, in block-table order.
        pos = torch.arange(md.seq_lens_cpu[i])
        slot = md.block_table[i, pos // block_size].long() * block_size + pos % block_size
        assert torch.equal(kv_cache[0].view(-1, num_kv_heads, head_size)[slot], dense_k[i])
        assert torch.equal(kv_cache[1].view(-1, num_kv_heads, head_size)[slot], dense_v[i])
    assert torch.count_nonzero(out[md.num_actual_tokens :]) == 0, "padding rows must stay zero"


def test_torch_ref_many_decodes_cross_groups():
    # More decodes than the reference's batching group, with very different lengths in one group.
    reqs = [(1 + (7 * i) % 45, 1) for i in range(70)]
    query, key, value, kv_cache, md, dense_k, dense_v = _build(reqs, 2, 1, 8, 16, torch.float32, seed=7)
    impl = TorchRefImpl(2, 8, 0.3, 1)
    out = impl.forward(query, key, value, kv_cache, md)
    for i in range(md.num_reqs):
        expected = _dense_attention(query[i : i + 1], dense_k[i], dense_v[i], 0.3, None, None)
        torch.testing.assert_close(out[i : i + 1].double(), expected, atol=1e-5, rtol=1e-5)
