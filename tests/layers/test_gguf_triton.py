"""The Triton GGUF product (kernels/gguf_triton.py) against the torch decoders' dense weight, under the interpreter
on the CPU: float32 within 1e-5 relative (summation order only), 16-bit within the type's rounding."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import quantize

from pagedllm.kernels.gguf_triton import TRITON_BLOCKS, gguf_mm_triton
from pagedllm.layers.quantization.gguf_dequant import dequantize

# Byte offsets of each block's float16 fields (d, and Q4_K's dmin), set to finite values in random blocks.
_HALF_FIELDS = {T.Q4_K: (0, 2), T.Q6_K: (208,)}


def _packed(qtype: T, n: int, k: int, seed: int) -> torch.Tensor:  # -> [n, row_bytes] uint8
    gen = np.random.default_rng(seed)
    if qtype in _HALF_FIELDS:
        # gguf-py cannot quantize k-quants: random blocks, whose bit fields are all valid codes.
        block, nbytes = TRITON_BLOCKS[int(qtype)]
        raw = gen.integers(0, 256, size=(n * k // block, nbytes), dtype=np.uint8)
        for off in _HALF_FIELDS[qtype]:
            raw[:, off:off + 2] = gen.uniform(-0.05, 0.05, size=(len(raw), 1)).astype(np.float16).view(np.uint8)
        return torch.from_numpy(raw.reshape(n, -1))
    return torch.from_numpy(quantize(gen.standard_normal((n, k)).astype(np.float32), qtype))


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_0, T.Q5_0, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("m,n", [(1, 70), (5, 64), (19, 33)])
def test_float32_product_equals_the_dequantized_weights(qtype, m, n):
    k = 512
    packed = _packed(qtype, n, k, seed=m * 1000 + n)
    dense = dequantize(packed, qtype, (n, k))  # [n, k] float32, gguf-py's values
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(n))
    got = gguf_mm_triton(x, packed, qtype)
    want = x.double() @ dense.double().t()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K], ids=lambda t: t.name)
def test_half_activations_see_the_weight_rounded_to_half(qtype):
    n, k = 48, 256
    packed = _packed(qtype, n, k, seed=7)
    dense = dequantize(packed, qtype, (n, k), torch.float16)
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(1)).half()
    got = gguf_mm_triton(x, packed, qtype)
    assert got.dtype == torch.float16
    want = x.float() @ dense.float().t()
    torch.testing.assert_close(got.float(), want, rtol=2e-3, atol=2e-3 * want.abs().max().item())


def test_bad_inputs_name_the_argument():
    packed = _packed(T.Q8_0, 8, 64, seed=0)
    with pytest.raises(ValueError, match="qtype 13 has no Triton kernel"):
        gguf_mm_triton(torch.zeros(1, 64), packed, 13)
    with pytest.raises(ValueError, match="K=96 must be a multiple of 32 with 102 bytes"):
        gguf_mm_triton(torch.zeros(1, 96), packed, T.Q8_0)
    with pytest.raises(ValueError, match="x must be float32"):
        gguf_mm_triton(torch.zeros(1, 64, dtype=torch.int32), packed, T.Q8_0)
    with pytest.raises(ValueError, match="qweight must be a 2-D uint8"):
        gguf_mm_triton(torch.zeros(1, 64), packed.float(), T.Q8_0)
