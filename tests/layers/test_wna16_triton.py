"""The Triton W4A16/W8A16 kernel (interpreted) against the torch unpack oracle, for AWQ, GPTQ and compressed-tensors
tensors converted to the common packed layout."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from pagedllm.kernels.cpu import wna16_gemm as cpu_kernel
from pagedllm.kernels.wna16 import wna16_matmul
from pagedllm.layers.quantization import wna16_layout as layout
from pagedllm.layers.quantization.unpack import (AWQ_REVERSE_ORDER, awq_dequantize, ct_pack_dequantize,
                                                 gptq_dequantize, pack_int32, unpack_int32)

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU runs need TRITON_INTERPRET=1")


def _run(w: layout.WNA16Weights, x: torch.Tensor, **kw) -> torch.Tensor:
    if w.perm is not None:
        x = x.index_select(1, w.perm)
    return wna16_matmul(x, w.qweight, w.scales, w.zeros, w.bits, w.group_size, w.g_idx, **kw)


def _check(w: layout.WNA16Weights, oracle: torch.Tensor, m: int, dtype: torch.dtype, gen, **kw) -> None:
    k = oracle.shape[1]
    x = torch.randn(m, k, generator=gen).to(dtype)
    want = torch.nn.functional.linear(x.float(), oracle.to(dtype).float())
    assert torch.allclose(w.dequantize(), oracle, atol=1e-5)
    got = _run(w, x, **kw).float()
    tol = 1e-3 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got, want, atol=tol * k ** 0.5, rtol=tol), (got - want).abs().max()


def _awq_pack(vals: torch.Tensor) -> torch.Tensor:  # [R, C] in 0..15 -> [R, C/8] AWQ-interleaved words
    order = torch.arange(vals.shape[1]).view(-1, 8)[:, list(AWQ_REVERSE_ORDER)].reshape(-1)
    inter = torch.empty_like(vals)
    inter[:, order] = vals
    return pack_int32(inter, 4, 1)


@pytest.mark.parametrize("m,n,k,g,dtype", [(1, 72, 96, 32, torch.float32), (3, 40, 128, 64, torch.float16),
                                           (17, 136, 256, 128, torch.float32)])
def test_awq(m, n, k, g, dtype):
    gen = torch.Generator().manual_seed(m)
    q = torch.randint(0, 16, (k, n), generator=gen)
    z = torch.randint(0, 16, (k // g, n), generator=gen)
    s = (torch.rand(k // g, n, generator=gen) * 0.02 + 0.005).to(dtype)
    qw, qz = _awq_pack(q), _awq_pack(z)
    oracle = awq_dequantize(qw, qz, s, g)
    _check(layout.from_awq(qw, qz, s, g), oracle, m, dtype, gen)


@pytest.mark.parametrize("bits,g,act_order,sym,m", [
    (4, 32, False, True, 1), (4, 64, True, False, 3), (8, 128, True, True, 17), (8, -1, False, False, 3),
    (4, 128, False, False, 17), (4, -1, True, True, 1), (8, 32, False, True, 1)])
def test_gptq(bits, g, act_order, sym, m):
    gen = torch.Generator().manual_seed(bits * 100 + m)
    n, k = 40, 256
    groups = 1 if g == -1 else k // g
    q = torch.randint(0, 1 << bits, (k, n), generator=gen)
    if sym:
        z = torch.full((groups, n), (1 << (bits - 1)) - 1)  # stored minus one (checkpoint_format gptq)
    else:
        z = torch.randint(0, (1 << bits) - 1, (groups, n), generator=gen)
    s = torch.rand(groups, n, generator=gen) * 0.02 + 0.005
    gs = k if g == -1 else g
    g_idx = (torch.arange(k) // gs).int()
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=gen)].contiguous()
    qw, qz = pack_int32(q, bits, 0), pack_int32(z, bits, 1)
    oracle = gptq_dequantize(qw, qz, s, g_idx, bits, 1)
    w = layout.from_gptq(qw, qz, s, g_idx if act_order else None, bits, g, 1)
    assert (w.perm is not None) == (act_order and g != -1)
    _check(w, oracle, m, torch.float32, gen)


def test_gptq_uneven_groups_keep_g_idx():
    """Act-order groups of unequal sizes: the sorted group index is read per row."""
    gen = torch.Generator().manual_seed(5)
    n, k, bits = 24, 64, 4
    g_idx = torch.randint(0, 4, (k,), generator=gen).int()
    q = torch.randint(0, 16, (k, n), generator=gen)
    z = torch.randint(0, 15, (4, n), generator=gen)
    s = torch.rand(4, n, generator=gen) * 0.02
    qw, qz = pack_int32(q, bits, 0), pack_int32(z, bits, 1)
    w = layout.from_gptq(qw, qz, s, g_idx, bits, 16, 1)
    assert w.g_idx is not None
    _check(w, gptq_dequantize(qw, qz, s, g_idx, bits, 1), 3, torch.float32, gen)


@pytest.mark.parametrize("bits,g,sym,m,dtype", [(4, 32, True, 1, torch.float16), (4, None, False, 17, torch.float32),
                                                (8, 64, False, 3, torch.float32)])
def test_compressed_tensors(bits, g, sym, m, dtype):
    gen = torch.Generator().manual_seed(bits + m)
    n, k = 48, 192
    groups = 1 if g is None else k // g
    q = torch.randint(0, 1 << bits, (n, k), generator=gen)
    s = (torch.rand(n, groups, generator=gen) * 0.02 + 0.005).to(dtype)
    zp = None if sym else pack_int32(torch.randint(0, 1 << bits, (n, groups), generator=gen), bits, 0)
    wp = pack_int32(q, bits, 1)
    oracle = ct_pack_dequantize(wp, s, zp, bits, k if g is None else g)
    _check(layout.from_compressed_tensors(wp, s, zp, bits, g), oracle, m, dtype, gen)


def test_split_k_and_odd_tiles():
    """Split-K partial sums and N, K tails that fill no whole block."""
    gen = torch.Generator().manual_seed(9)
    n, k, g = 56, 320, 32
    q = torch.randint(0, 16, (k, n), generator=gen)
    z = torch.randint(0, 16, (k // g, n), generator=gen)
    s = torch.rand(k // g, n, generator=gen) * 0.02
    qw, qz = _awq_pack(q), _awq_pack(z)
    w = layout.from_awq(qw, qz, s, g)
    _check(w, awq_dequantize(qw, qz, s, g), 5, torch.float32, gen, split_k=3, block=(16, 32, 64))


@pytest.mark.parametrize("m,swap", [(16, False), (128, True)])
def test_sixteen_bit_tiles_read_the_weight_the_torch_path_rounds(m: int, swap: bool):
    """The 4-bit tiles of 16-bit activations may dequantize with one fused multiply-add a value (``_scaled_value``):
    identity rows read their weight out exactly, which must be the torch path's ``((q - z) * s)`` rounded to
    float16 in all but a rare tie (the offset's rounding, ~2**-19 of a scale), and then by one unit at most."""
    gen = torch.Generator().manual_seed(5)
    n, k, g = 64, 128, 32
    q = torch.randint(0, 16, (k, n), generator=gen)
    z = torch.randint(0, 16, (k // g, n), generator=gen)
    s = (torch.rand(k // g, n, generator=gen) * 0.02 + 0.001).to(torch.float16)
    qw, qz = _awq_pack(q), _awq_pack(z)
    w = layout.from_awq(qw, qz, s, g)
    want = awq_dequantize(qw, qz, s, g).to(torch.float16).t()  # [K, N]: row i is what input i multiplies
    x = torch.eye(m, k, dtype=torch.float16)
    got = wna16_matmul(x, w.qweight, w.scales, w.zeros, w.bits, w.group_size, swap_ab=swap, fma_dequant=True)
    rows = want[:m]
    ulp = (torch.nextafter(rows.abs(), torch.tensor(float("inf"), dtype=torch.float16)) - rows.abs()).float()
    diff = (got.float() - rows.float()).abs()
    assert (diff <= ulp).all(), diff.max()
    assert (diff > 0).float().mean() < 0.01
    # The two-step dequantization (subtract, multiply) rounds once: those bits exactly.
    exact = wna16_matmul(x, w.qweight, w.scales, w.zeros, w.bits, w.group_size, swap_ab=swap, fma_dequant=False)
    assert torch.equal(exact, rows)


@pytest.mark.parametrize("act_order,dtype,split", [(False, torch.float32, 3), (True, torch.float16, 1)])
def test_weight_as_first_operand(act_order: bool, dtype: torch.dtype, split: int):
    """The tile product computed as W x^T (``swap_ab``): the same oracle over N, K and M tails, split-K partial
    sums and act-order groups read per row."""
    gen = torch.Generator().manual_seed(12)
    n, k, g = 88, 320, 32
    q = torch.randint(0, 16, (k, n), generator=gen)
    s = (torch.rand(k // g, n, generator=gen) * 0.02).to(dtype)
    qz = pack_int32(torch.randint(0, 15, (k // g, n), generator=gen), 4, 1)
    g_idx = (torch.randperm(k, generator=gen) % (k // g)).to(torch.int32) if act_order else None
    qw = pack_int32(q, 4, 0)
    w = layout.from_gptq(qw, qz, s, g_idx, 4, g, 0)
    oracle = gptq_dequantize(qw, qz, s, g_idx if act_order else torch.arange(k, dtype=torch.int32) // g, 4, 0)
    _check(w, oracle, 21, dtype, gen, split_k=split, block=(16, 32, 64), swap_ab=True)
    _check(w, oracle, 70, dtype, gen)  # past 64 rows the default tile is W x^T


def test_bad_input_names_field():
    qw = torch.zeros(4, 8, dtype=torch.int32)
    s = torch.ones(1, 8)
    with pytest.raises(ValueError, match="bits 3"):
        wna16_matmul(torch.zeros(1, 32), qw, s, s, 3, 32)
    with pytest.raises(ValueError, match="qweight"):
        wna16_matmul(torch.zeros(1, 16), qw, s, s, 4, 32)


@pytest.mark.parametrize("method", ["awq", "gptq", "gptq-act-order", "gptq-8bit-one-group", "ct-w4a16-asym",
                                    "ct-w8a16-sym-channel"])
def test_linear_method_kernel_path_equals_torch_path(method):
    """A row-parallel rank's linear (act-order: global group ids), once process_weights_after_loading has moved it to
    this device's kernel layout (on the CPU the compiled kernel's rows, or the torch path where it does not read
    the shape), gives the product of the checkpoint tensors as the format's own unpacking dequantizes them."""
    from pagedllm.layers.linear import RowParallelLinear
    from pagedllm.layers.quantization.awq import AWQLinearMethod
    from pagedllm.layers.quantization.compressed_tensors import PackedWeightOnlyLinearMethod
    from pagedllm.layers.quantization.gptq import GPTQLinearMethod

    make = {
        "awq": lambda: AWQLinearMethod(32),
        "gptq": lambda: GPTQLinearMethod(4, 32, desc_act=False, zero_offset=1),
        "gptq-act-order": lambda: GPTQLinearMethod(4, 32, desc_act=True, zero_offset=1),
        "gptq-8bit-one-group": lambda: GPTQLinearMethod(8, -1, desc_act=False, zero_offset=0),
        "ct-w4a16-asym": lambda: PackedWeightOnlyLinearMethod(4, 32, symmetric=False),
        "ct-w8a16-sym-channel": lambda: PackedWeightOnlyLinearMethod(8, None, symmetric=True),
    }[method]
    k, n = 256, 48
    layer = RowParallelLinear(k, n, bias=False, quant_method=make(), tp_rank=1, tp_size=2)
    gen = torch.Generator().manual_seed(3)
    for p in layer.parameters():
        if p.dtype == torch.int32:
            p.data = torch.randint(-2**31, 2**31 - 1, p.shape, generator=gen, dtype=torch.int64).to(torch.int32)
        else:
            p.data = torch.rand(p.shape, generator=gen) * 0.02 + 0.005
    if method == "gptq-act-order":
        layer.g_idx.data = (torch.randperm(k, generator=gen)[:k // 2] // 32).int()
    raw = {name: t.detach().clone() for name, t in layer.named_parameters()}
    local = torch.arange(k // 2, dtype=torch.int32)
    oracle = {
        "awq": lambda: awq_dequantize(raw["qweight"], raw["qzeros"], raw["scales"], 32),
        "gptq": lambda: gptq_dequantize(raw["qweight"], raw["qzeros"], raw["scales"], local // 32, 4, 1),
        "gptq-act-order": lambda: gptq_dequantize(raw["qweight"], raw["qzeros"], raw["scales"], raw["g_idx"], 4, 1),
        "gptq-8bit-one-group": lambda: gptq_dequantize(raw["qweight"], raw["qzeros"], raw["scales"], local * 0, 8, 0),
        "ct-w4a16-asym": lambda: ct_pack_dequantize(raw["weight_packed"], raw["weight_scale"],
                                                    raw["weight_zero_point"], 4, 32),
        "ct-w8a16-sym-channel": lambda: ct_pack_dequantize(raw["weight_packed"], raw["weight_scale"], None, 8, k // 2),
    }[method]()
    layer.quant_method.process_weights_after_loading(layer)
    if cpu_kernel.available():  # all but act-order groups of uneven sizes, which keep the common layout
        assert isinstance(layer.wna16, layout.WNA16Rows) == (method != "gptq-act-order")
    x = torch.randn(3, k // 2, generator=gen)
    got = layer.quant_method.apply(layer, x, None)
    want = x @ oracle.t()
    assert torch.allclose(got, want, atol=1e-3, rtol=1e-3), (got - want).abs().max()
    assert torch.equal(layer.quant_method.dequantize(layer), oracle)


@pytest.mark.parametrize("act_order", [False, True])
def test_many_rows_take_the_dequantized_weight(act_order: bool):
    """From DENSE_FROM_ROWS rows on, the weight is dequantized by the Triton kernel and multiplied densely:
    same oracle, odd N and K tails, act-order rows in kernel order."""
    gen = torch.Generator().manual_seed(11)
    n, k, g = 88, 320, 32
    q = torch.randint(0, 16, (k, n), generator=gen)
    s = torch.rand(k // g, n, generator=gen) * 0.02
    qz = pack_int32(torch.randint(0, 15, (k // g, n), generator=gen), 4, 1)
    g_idx = (torch.randperm(k, generator=gen) % (k // g)).to(torch.int32) if act_order else None
    qw = pack_int32(q, 4, 0)
    w = layout.from_gptq(qw, qz, s, g_idx, 4, g, 0)
    oracle = gptq_dequantize(qw, qz, s, g_idx if act_order else torch.arange(k, dtype=torch.int32) // g, 4, 0)
    _check(w, oracle, 7, torch.float32, gen, dense_from_rows=1)


@pytest.mark.parametrize("bits,g,k,n,split", [(4, 128, 512, 96, None), (4, 32, 256, 40, 3), (8, 64, 256, 72, 2),
                                              (4, 512, 1024, 200, None), (8, 256, 256, 33, 1),
                                              (2, 128, 256, 40, None)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_one_row_gemv_against_the_oracle(bits, g, k, n, split, dtype):
    """The one-row kernel (scales applied once per step of rows, not per weight) over group sizes, zero points,
    split rows and a column count no block divides."""
    from pagedllm.kernels.wna16 import wna16_gemv

    gen = torch.Generator().manual_seed(bits * k + n)
    q = torch.randint(0, 1 << bits, (k, n), generator=gen)
    z = torch.randint(0, 1 << bits, (k // g, n), generator=gen).float()
    s = (torch.rand(k // g, n, generator=gen) * 0.01 + 0.002).to(dtype)
    x = torch.randn(1, k, generator=gen).to(dtype)
    w = (q.float() - z.repeat_interleave(g, 0)) * s.float().repeat_interleave(g, 0)  # [K, N]
    want = x.float() @ w
    got = wna16_gemv(x, pack_int32(q, bits, 0).contiguous(), s, z, bits, g, block_n=32, split_k=split)
    assert got.shape == (1, n) and got.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 2e-3
    assert torch.allclose(got.float(), want, atol=tol * k ** 0.5, rtol=tol), (got.float() - want).abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k,n,g,zmax,split", [(512, 96, 128, 15, None), (256, 40, 32, 16, 3), (1024, 72, 64, 8, 2)])
def test_pairs_gemv_moves_the_right_values(dtype, k, n, g, zmax, split):
    """The pairs GEMV's data movement (each word's pairs of values, the activation pairs it regroups with PRMTs,
    ``-(M + z)`` in half precision) under the interpreter, where its PTX's arithmetic runs as float32 Triton ops:
    equal to the float32 kernel up to summation order. The PTX itself is checked on the GPU
    (``tests/gpu/test_wna16_gpu.py``)."""
    from pagedllm.kernels.wna16_gemv import wna16_gemv

    gen = torch.Generator().manual_seed(k + n + zmax)
    qw = pack_int32(torch.randint(0, 16, (k, n), generator=gen), 4, 0).contiguous()
    z = torch.randint(0, zmax + 1, (k // g, n), generator=gen).float()
    s = (torch.rand(k // g, n, generator=gen) * 0.01 + 0.002).to(dtype)
    x = torch.randn(1, k, generator=gen).to(dtype)
    x = torch.cat([torch.zeros(1, 1, dtype=dtype), x], 1)[:, 1:]  # a view two bytes into its storage
    got = wna16_gemv(x, qw, s, z, 4, g, block_n=32, split_k=split, pairs=True).float()
    want = wna16_gemv(x, qw, s, z, 4, g, block_n=32, split_k=split, pairs=False).float()
    assert torch.allclose(got, want, rtol=1e-2, atol=1e-2 * want.abs().max().item()), (got - want).abs().max()


@pytest.mark.parametrize("m,block,swap", [(5, (16, 32, 64), False), (40, (32, 32, 32), False),
                                          (70, (64, 32, 64), True)])
def test_pairs_dequantization_moves_the_right_values(m, block, swap):
    """The tiles' pairs dequantization (``_pairs_tile``: each word's values from its PTX, the scale and ``-(M + z)``
    pairs built from the scales and zero points, the values joined into the tile) under the interpreter, where the
    PTX's arithmetic runs as Triton ops: bit for bit the two-step path's product, x W^T and W x^T. Float16 (the
    interpreter's bfloat16 is broken); the PTX itself is checked on the GPU and by
    ``tests/kernels/test_pairs_ptx.py``."""
    k, n, g = 256, 48, 64
    gen = torch.Generator().manual_seed(m)
    qw = pack_int32(torch.randint(0, 16, (k, n), generator=gen), 4, 0).contiguous()
    z = torch.randint(0, 17, (k // g, n), generator=gen).float()
    s = (torch.rand(k // g, n, generator=gen) * 0.01 + 0.002).half()
    x = torch.randn(m, k, generator=gen).half()
    kw = dict(block=block, swap_ab=swap, dense_from_rows=1 << 30, gemv=False, fma_dequant=False, split_k=1)
    got = wna16_matmul(x, qw, s, z, 4, g, pairs_dequant=True, **kw)
    assert torch.equal(got, wna16_matmul(x, qw, s, z, 4, g, pairs_dequant=False, **kw))


def _one_row_case(k: int, n: int, g: int, seed: int):  # -> x [1, K], 4-bit words [K / 8, N], scales, zeros [K / g, N]
    gen = torch.Generator().manual_seed(seed)
    qw = pack_int32(torch.randint(0, 16, (k, n), generator=gen), 4, 0).contiguous()
    z = torch.randint(0, 16, (k // g, n), generator=gen).float()
    s = torch.rand(k // g, n, generator=gen) * 0.01
    return torch.randn(1, k, generator=gen), qw, s, z


def test_gemv_splits_summed_in_the_launch_equal_those_summed_after(monkeypatch):
    """Split rows: the last split of each column tile adds the float32 partial sums in split order inside the launch
    (and leaves the tile counts at zero for the next); without a count buffer (a first call inside a graph capture)
    the splits are summed afterwards, in the same order: the same bits."""
    from pagedllm.kernels import launch, wna16

    g = 64
    x, qw, s, z = _one_row_case(512, 72, g, seed=5)
    fused = wna16.wna16_gemv(x, qw, s, z, 4, g, block_n=32, split_k=4)
    assert not launch.split_counts(x.device, 3).any()
    monkeypatch.setattr(launch, "split_counts", lambda device, tiles: None)
    assert torch.equal(fused, wna16.wna16_gemv(x, qw, s, z, 4, g, block_n=32, split_k=4))


def test_one_row_product_takes_the_gemv():
    """``wna16_matmul`` sends one row with groups in order to the GEMV, and act-order indices to the tile kernel."""
    from pagedllm.kernels.wna16 import wna16_gemv

    k, g = 256, 64
    x, qw, s, z = _one_row_case(k, 48, g, seed=11)
    assert torch.equal(wna16_matmul(x, qw, s, z, 4, g), wna16_gemv(x, qw, s, z, 4, g))
    tile = wna16_matmul(x, qw, s, z, 4, g, gemv=False)
    assert not torch.equal(tile, wna16_gemv(x, qw, s, z, 4, g))  # another summation order
    g_idx = (torch.arange(k) // g).int()
    assert torch.equal(wna16_matmul(x, qw, s, z, 4, g, g_idx), wna16_matmul(x, qw, s, z, 4, g, g_idx, gemv=False))


def test_one_row_gemv_refuses_what_it_cannot_run():
    from pagedllm.kernels.wna16 import wna16_gemv

    qw = torch.zeros(16, 8, dtype=torch.int32)
    s = torch.ones(1, 8)
    with pytest.raises(ValueError, match="one row and a group size divisible by 32"):
        wna16_gemv(torch.zeros(2, 128), qw, s, s, 4, 128)
    with pytest.raises(ValueError, match="group 48"):
        wna16_gemv(torch.zeros(1, 128), qw, s, s, 4, 48)
    with pytest.raises(ValueError, match="4-bit weights and 16-bit activations"):
        wna16_gemv(torch.zeros(1, 128, dtype=torch.float16), torch.zeros(32, 8, dtype=torch.int32), s, s, 8, 128,
                   pairs=True)


@pytest.mark.parametrize("bits,g,k,n,act_order,tile", [
    (4, 128, 384, 296, False, None),  # a tile within one group: one row of scales a tile
    (4, 64, 256, 72, False, (64, 32, 1)),  # the group is one tile exactly
    (4, 32, 320, 40, False, None),  # several groups a tile: scales gathered per row
    (8, 128, 256, 36, False, (128, 64, 2)),
    (2, 64, 192, 48, False, (64, 64, 1)),
    (4, 64, 256, 88, True, (64, 64, 1)),  # act-order: a group index per row
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # bfloat16: the interpreter's casts are wrong
def test_dequantized_weight_is_the_layouts_bit_for_bit(bits, g, k, n, act_order, tile, dtype):
    """The dense weight of the many-row path: every value ``((q - z) * s)`` rounded once into the dtype, as the torch
    layout computes it, over group shapes, widths, N tails and act-order rows."""
    from pagedllm.kernels.wna16 import wna16_dequantize

    gen = torch.Generator().manual_seed(bits * 1000 + k + n)
    q = torch.randint(0, 1 << bits, (k, n), generator=gen)
    s = (torch.rand(k // g, n, generator=gen) * 0.02 + 0.001).to(dtype)
    qz = pack_int32(torch.randint(0, (1 << bits) - 1, (k // g, n), generator=gen), bits, 1)
    g_idx = (torch.randperm(k, generator=gen) % (k // g)).to(torch.int32) if act_order else None
    w = layout.from_gptq(pack_int32(q, bits, 0), qz, s, g_idx, bits, g, 0)
    rows = w.g_idx.long() if w.g_idx is not None else torch.arange(k) // w.group_size
    want = (unpack_int32(w.qweight, bits, 0) - w.zeros[rows]).float() * w.scales.float()[rows]  # [K, N], kernel rows
    got = wna16_dequantize(w.qweight, w.scales, w.zeros, bits, w.group_size, w.g_idx, dtype, tile=tile)
    assert got.shape == (k, n) and got.dtype == dtype
    assert torch.equal(got, want.to(dtype))
