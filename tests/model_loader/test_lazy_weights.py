"""LazyWeight: what a weight loader does to it gives the same tensor as to the tensor read whole."""
from __future__ import annotations

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pagedllm.model_loader.lazy_weights import LazyWeight


def test_narrow_split_and_slices_read_the_same_values(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {"w": torch.randn(12, 10, generator=g), "b": torch.randn(7, generator=g), "s": torch.tensor(2.5),
               "h": torch.randn(6, 4, generator=g).to(torch.bfloat16)}
    path = str(tmp_path / "t.safetensors")
    save_file(tensors, path)
    with safe_open(path, framework="pt") as f:
        lazy = {k: LazyWeight.of(f.get_slice(k)) for k in f.keys()}
        w, full = lazy["w"], tensors["w"]
        assert w.shape == full.shape and w.dtype == torch.float32 and w.dim() == 2
        assert torch.equal(w.narrow(0, 3, 4).narrow(1, 2, 5).materialize(), full.narrow(0, 3, 4).narrow(1, 2, 5))
        for got, want in zip(w.split([5, 4, 3], dim=0), full.split([5, 4, 3], dim=0)):
            assert torch.equal(got.materialize(), want)
        for got, want in zip(w.split(4, dim=1), full.split(4, dim=1)):
            assert got.shape == want.shape and torch.equal(got.materialize(), want)
        assert torch.equal(lazy["b"][2:6].materialize(), tensors["b"][2:6])
        assert lazy["h"].dtype == torch.bfloat16
        # Anything else reads the region: a parameter's copy_, a method, a torch function.
        dst = torch.empty(4, 10)
        dst.copy_(w[8:12])
        assert torch.equal(dst, full[8:12])
        assert torch.equal(lazy["b"].float() * 2, tensors["b"] * 2)
        assert torch.equal(torch.cat([w[:2], w[2:4]]), full[:4])
        assert float(lazy["s"].materialize()) == 2.5
