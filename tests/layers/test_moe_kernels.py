"""The Triton MoE kernels against the per-expert reference (Triton's interpreter without a GPU): the
alignment's layout, and the fused experts in float32 and float16 over top-k, configs and routings."""
from __future__ import annotations

import pytest
import torch

from pagedllm.kernels.moe import fused_experts
from pagedllm.kernels.moe.align import max_padded_pairs, moe_align_block_size
from pagedllm.kernels.moe.configs import TUNED_REACH, get_config, nearest_tuned
from pagedllm.layers.fused_moe import fused_experts_ref, select_experts


def _ids(tokens: int, top_k: int, num_experts: int, seed: int, exclude: tuple[int, ...] = ()) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([e for e in range(num_experts) if e not in exclude])
    rows = [allowed[torch.randperm(len(allowed), generator=g)[:top_k]] for _ in range(tokens)]
    return torch.stack(rows).to(torch.int32)


@pytest.mark.parametrize("tokens,top_k,num_experts,block_m,exclude", [
    (5, 2, 6, 16, (3,)),  # an expert with no pair
    (1, 1, 8, 16, ()),  # fewer pairs than experts
    (40, 2, 4, 16, ()),  # groups longer than a block
    (9, 8, 16, 32, (0, 15)),
    (300, 1, 3, 64, ()),  # more pairs than one loop chunk
])
def test_align_layout(tokens, top_k, num_experts, block_m, exclude):
    ids = _ids(tokens, top_k, num_experts, seed=tokens, exclude=exclude)
    sorted_ids, expert_ids, num_padded = moe_align_block_size(ids, num_experts, block_m)
    flat = ids.flatten().tolist()
    pairs = len(flat)
    counts = [flat.count(e) for e in range(num_experts)]
    want_rows = sum(-(-c // block_m) * block_m for c in counts)
    assert num_padded.item() == want_rows
    assert sorted_ids.numel() >= max_padded_pairs(pairs, num_experts, block_m) >= want_rows
    layout = sorted_ids.tolist()
    assert sorted(p for p in layout if p != pairs) == list(range(pairs))  # every pair once
    assert all(p == pairs for p in layout[want_rows:])
    blocks = expert_ids.tolist()
    # Groups in increasing expert id, each in pair order, padded to whole blocks.
    want, want_blocks = [], []
    for e in range(num_experts):
        group = [p for p in range(pairs) if flat[p] == e]
        if group:
            group += [pairs] * (-len(group) % block_m)
            want += group
            want_blocks += [e] * (len(group) // block_m)
    assert layout[:want_rows] == want
    assert blocks[: len(want_blocks)] == want_blocks
    assert all(b == -1 for b in blocks[len(want_blocks):])


def test_align_rejects_int64_ids():
    with pytest.raises(ValueError, match="topk_ids must be int32; got torch.int64"):
        moe_align_block_size(torch.zeros(2, 1, dtype=torch.int64), 4, 16)


def _weights(num_experts: int, hidden: int, inter: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=g) * hidden**-0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=g) * inter**-0.5).to(dtype)
    return g, w13, w2


TOL = {torch.float32: dict(atol=2e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}
# Configs with several row blocks and column/K tiles over the tiny shapes, beside the table's own.
SMALL = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=2, num_warps=4, num_stages=2)
WIDE = dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=16, GROUP_M=1, num_warps=4, num_stages=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("top_k,num_experts,tokens,config", [
    (1, 8, 7, None),
    (2, 8, 33, SMALL),
    (2, 4, 1, None),
    (8, 16, 5, WIDE),
])
def test_fused_experts_matches_reference(dtype, top_k, num_experts, tokens, config):
    hidden, inter = 48, 40  # not multiples of the column tiles: masked edges
    g, w13, w2 = _weights(num_experts, hidden, inter, dtype, seed=top_k)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    weights, ids = select_experts(torch.randn(tokens, num_experts, generator=g), top_k, renormalize=top_k > 1)
    got = fused_experts(x, w13, w2, weights, ids, config)
    want = fused_experts_ref(x, w13, w2, weights, ids)
    assert got.dtype == dtype and got.shape == (tokens, hidden)
    torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_experts_one_expert_for_all_and_experts_without_tokens(dtype):
    """Every token picks experts 2 then 5 (the other six get nothing; their weights are NaN and never read)."""
    num_experts, hidden, inter, tokens = 8, 32, 32, 20
    g, w13, w2 = _weights(num_experts, hidden, inter, dtype, seed=9)
    for e in (0, 1, 3, 4, 6, 7):
        w13[e] = float("nan")
        w2[e] = float("nan")
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    ids = torch.tensor([[2, 5]] * tokens, dtype=torch.int32)
    weights = torch.rand(tokens, 2, generator=g)
    got = fused_experts(x, w13, w2, weights, ids, SMALL)
    torch.testing.assert_close(got, fused_experts_ref(x, w13, w2, weights, ids), **TOL[dtype])


def test_fused_experts_no_tokens():
    _, w13, w2 = _weights(4, 16, 16, torch.float32, seed=0)
    out = fused_experts(torch.empty(0, 16), w13, w2, torch.empty(0, 2), torch.empty(0, 2, dtype=torch.int32))
    assert out.shape == (0, 16)


def test_config_table_by_rows_per_expert():
    decode = get_config(8, 8, 128, torch.bfloat16)  # half a row per expert
    prefill = get_config(8192, 8, 128, torch.bfloat16)  # 512 rows per expert
    assert decode["BLOCK_M"] < prefill["BLOCK_M"]
    assert get_config(8, 8, 128, torch.float32)["BLOCK_K"] <= decode["BLOCK_K"]


def test_block_fp8_experts_take_their_own_prefill_tiles():
    """Block-wise float8 experts keep the decode tiles up to 32 rows an expert, then narrower prefill tiles than
    16-bit experts (the 128x128 tile spills with a scaled dot per 128-deep block) and 8 warps past 512 rows."""
    assert get_config(64, 2, 8, torch.bfloat16, block_fp8=True) == get_config(64, 2, 8, torch.bfloat16)  # 16 rows
    mid = get_config(256, 2, 8, torch.bfloat16, block_fp8=True)  # 64 rows per expert
    big = get_config(4096, 2, 8, torch.bfloat16, block_fp8=True)  # 1,024 rows per expert
    assert (mid["BLOCK_M"], mid["BLOCK_N"], mid["num_warps"]) == (64, 64, 4)
    assert (big["BLOCK_M"], big["BLOCK_N"], big["num_warps"]) == (64, 128, 8)
    assert get_config(4096, 2, 8, torch.bfloat16)["BLOCK_M"] == 128
    big["BLOCK_M"] = 1  # a copy: the caller may not change the table
    assert get_config(4096, 2, 8, torch.bfloat16, block_fp8=True)["BLOCK_M"] == 64


def test_tuned_config_reaches_only_nearby_token_counts():
    """A table swept at a few counts answers for counts near them; a prefill far from every swept count
    gets no decode tile from it (None: the rows-per-expert table decides)."""
    small, big = dict(BLOCK_M=16, tag=1), dict(BLOCK_M=128, tag=2)
    rows = [(1, small), (16, big)]
    assert nearest_tuned(rows, 1) == small and nearest_tuned(rows, 3) == small
    assert nearest_tuned(rows, 5) == big and nearest_tuned(rows, 16 * TUNED_REACH) == big
    assert nearest_tuned(rows, 16 * TUNED_REACH + 1) is None and nearest_tuned(rows, 4096) is None
    assert nearest_tuned(None, 8) is None and nearest_tuned([], 8) is None
    got = nearest_tuned(rows, 2)
    got["BLOCK_M"] = 99  # a copy: the caller may not change the table
    assert small["BLOCK_M"] == 16
