"""oneDNN CPU linears: same products as F.linear within float32 summation-order noise, packed or not."""
from __future__ import annotations

import torch

from pagedllm.layers import cpu_linear as cl


def test_cpu_linear_matches_f_linear_packed_and_unpacked(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(33, 64, generator=gen)
    w = torch.randn(96, 64, generator=gen)
    b = torch.randn(96, generator=gen)
    ref = torch.nn.functional.linear(x, w, b)
    packed = cl.PackedWeight()
    out = cl.cpu_linear(x, w, b, packed)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert (packed.get(w) is not None) == cl._ONEDNN_PACK
    # No room for a second copy: the dense weight is used, with the same result as the packed one.
    monkeypatch.setattr(cl, "available_ram_bytes", lambda: 0)
    short = cl.PackedWeight()
    assert short.get(w) is None
    assert torch.equal(cl.cpu_linear(x, w, b, short), out)
    # A replaced weight is packed again, not served from the old copy.
    w2 = w * 2
    torch.testing.assert_close(cl.cpu_linear(x, w2, None, packed), torch.nn.functional.linear(x, w2), atol=1e-5, rtol=1e-5)
