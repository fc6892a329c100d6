"""The MoE workspace that start-up reserves: it grows with tokens, top-k, experts and widths, matches the
buffers the fused experts allocate, and a model's figure is its largest layer's."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from pagedllm.kernels.moe.align import max_padded_pairs
from pagedllm.layers.fused_moe import MoEExperts
from pagedllm.layers.fused_moe.workspace import model_moe_workspace_bytes, moe_workspace_bytes


def test_grows_with_experts_topk_and_tokens():
    base = moe_workspace_bytes(256, 2, 8, 64, 32, torch.bfloat16)
    assert moe_workspace_bytes(256, 8, 8, 64, 32, torch.bfloat16) > base  # top-k
    assert moe_workspace_bytes(256, 2, 128, 64, 32, torch.bfloat16) > base  # more experts: more padding
    assert moe_workspace_bytes(512, 2, 8, 64, 32, torch.bfloat16) > base
    assert moe_workspace_bytes(256, 2, 8, 64, 32, torch.float32) > base
    assert moe_workspace_bytes(0, 2, 8, 64, 32, torch.bfloat16) < base


def test_counts_the_fused_experts_buffers():
    t, k, e, i, h = 100, 4, 16, 48, 40
    pairs = t * k
    padded = max_padded_pairs(pairs, e, 16)
    want = 2 * (pairs * i + pairs * h + t * h) + 4 * (padded + padded // 16 + 1)
    assert moe_workspace_bytes(t, k, e, i, h, torch.float16) == want


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="top_k >= 1.*got 4, 0, 8"):
        moe_workspace_bytes(4, 0, 8, 16, 16, torch.float16)


def test_model_takes_its_largest_layer():
    small = MoEExperts(8, 2, 32, 16, renormalize=True, params_dtype=torch.float16)
    big = MoEExperts(16, 4, 32, 64, renormalize=True, params_dtype=torch.float16)
    model = nn.ModuleList([small, big, nn.Linear(4, 4)])
    assert model_moe_workspace_bytes(model, 64) == moe_workspace_bytes(64, 4, 16, 64, 32, torch.float16)
    big.quantize_fp8()  # float8 experts keep 16-bit activations
    assert model_moe_workspace_bytes(model, 64) == moe_workspace_bytes(64, 4, 16, 64, 32, torch.float16)
    assert model_moe_workspace_bytes(nn.Linear(4, 4), 64) == 0
