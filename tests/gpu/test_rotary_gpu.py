"""Rotary kernels compiled for the GPU give the torch path's exact bits (no fused multiply-add sneaks in)."""
from __future__ import annotations

import pytest
import torch

from pagedllm.kernels import rotary as rot_k
from pagedllm.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("rotary_dim", "scaling"), [(128, 1.0), (64, 1.25)])
def test_rotary_kernel_matches_torch_path_bit_for_bit(dtype, rotary_dim, scaling):
    # torch rounds x1*cos, x2*sin and their difference separately; the kernel must do the same on the
    # GPU, where the compiler would otherwise fuse a product into the add (kernel_math.rope_combine).
    gen = torch.Generator(device="cuda").manual_seed(3)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    rope = RotaryEmbedding(128, inv_freq, scaling).to("cuda")
    positions = torch.tensor([0, 1, 17, 255, 1000, 4095, 31000], device="cuda")
    q = torch.randn(len(positions), 32, 128, generator=gen, device="cuda").to(dtype)
    k = torch.randn(len(positions), 8, 128, generator=gen, device="cuda").to(dtype)
    cos, sin = rope.cos_sin(positions, dtype)
    ref_q = rope._rotate(q, cos.unsqueeze(1), sin.unsqueeze(1))
    ref_k = rope._rotate(k, cos.unsqueeze(1), sin.unsqueeze(1))
    got_q, got_k = rot_k.rotary_neox_(positions, q.clone(), k.clone(), rope.inv_freq, 128, scaling)
    assert torch.equal(got_q, ref_q)
    assert torch.equal(got_k, ref_k)
