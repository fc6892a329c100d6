"""Packed CPU weights moved into one huge-page arena: same bytes, shared tensors stay shared, others untouched."""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.kernels.cpu.hugepages import HUGE_PAGE, huge_page_buffer, move_to_huge_pages


def _module(buffers: dict[str, torch.Tensor]) -> nn.Module:
    m = nn.Module()
    for name, t in buffers.items():
        m.register_buffer(name, t)
    return m


def test_buffers_move_into_one_arena_with_their_bytes() -> None:
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(0, 256, (300, 17), dtype=torch.uint8, generator=g)
    a = _module({"qweight_0": torch.randint(0, 256, (5, 34), dtype=torch.uint8, generator=g),
                 "qweight_1": torch.randint(0, 256, (1000,), dtype=torch.uint8, generator=g),
                 "scales": torch.randint(0, 256, (8,), dtype=torch.uint8, generator=g)})
    emb, head = _module({"qweight_data": shared}), _module({"qweight_data": shared})
    dense = _module({"qweight_0": torch.randn(4, 4)})  # not packed bytes: stays where it is
    model = nn.ModuleList([a, emb, head, dense])
    before = {(i, n): t.clone() for i, m in enumerate(model) for n, t in m._buffers.items()}
    old_dense, old_scales = dense.qweight_0, a.scales

    moved = move_to_huge_pages(model, ("qweight_", "qweight_data"))

    assert moved == 64 * 3 + 1024 + 300 * 17 + (-300 * 17 % 64)  # each start on a cache line, shared once
    for (i, n), want in before.items():
        assert torch.equal(model[i]._buffers[n], want), (i, n)
    assert head.qweight_data is emb.qweight_data
    assert dense.qweight_0 is old_dense and a.scales is old_scales  # not named / not packed bytes: untouched
    ptrs = sorted(t.data_ptr() for t in (a.qweight_0, a.qweight_1, emb.qweight_data))
    assert all(p % 64 == 0 for p in ptrs)
    assert ptrs[-1] - ptrs[0] < moved  # one arena
    assert a.qweight_0.untyped_storage().data_ptr() == emb.qweight_data.untyped_storage().data_ptr()


def test_huge_page_buffer_starts_on_a_huge_page() -> None:
    buf = huge_page_buffer(3 * HUGE_PAGE + 5)
    assert buf.numel() == 3 * HUGE_PAGE + 5 and buf.dtype == torch.uint8
    assert buf.data_ptr() % HUGE_PAGE == 0
    buf.fill_(7)
    assert int(buf[-1]) == 7


def test_nothing_to_move() -> None:
    assert move_to_huge_pages(nn.Linear(4, 4), ("qweight_",)) == 0

