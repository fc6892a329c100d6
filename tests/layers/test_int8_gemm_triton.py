"""The fused W8A8 products (``kernels/int8_gemm.py``) against the torch path of ``layers/quantization/int8.py``
under Triton's interpreter (tests/conftest.py turns it on without a GPU): the same bits for 1-16 rows (decode)
and for more (tiles), ragged tiles, rows of very different ranges and a row of zeros."""
from __future__ import annotations

import pytest
import torch

from pagedllm.kernels import int8_gemm, int8_quant
from pagedllm.layers.quantization.int8 import w8a8_linear
from test_int8_triton import _rows  # rows of very different ranges, a run of equal values, a row of zeros


def _weight(n: int, k: int, dtype: torch.dtype, seed: int):  # int8 [n, k], scales [n, 1], bias [n]
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    w[0] = -128  # the extreme product: -128 * -128 in every column a quantized row reaches -128
    ws = torch.rand(n, 1, generator=g) * 1e-2
    return w, ws, (torch.randn(n, generator=g) * 0.1).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(
    "k,n,tile",
    [
        (200, 50, {"block_k": 64, "block_n": 16}),  # K: 3 steps + 8; N: 3 tiles + 2
        (1000, 72, {}),  # the default tile: K 256 deep (3 steps + 232), N 16 wide (4 tiles + 8)
    ],
)
def test_decode_product_is_bit_exact(dtype, m, bias, k, n, tile):
    x = _rows(m, k, dtype, seed=m * k)
    w, ws, b = _weight(n, k, dtype, seed=n)
    b = b if bias else None
    got = int8_gemm.w8a8_decode(x, w, ws, b, **tile)
    want = w8a8_linear(x, w, ws, b, act_symmetric=True)  # on CPU: quantize_int8_rows, torch._int_mm, epilogue
    assert got.shape == (m, n) and got.dtype == dtype
    assert torch.equal(got, want)


@pytest.mark.parametrize("m", [1, 5])
def test_prequantized_rows_give_the_same_bits(m):
    # The two-launch form (rows quantized by int8_quant.quantize_rows, the kernel reading int8 rows).
    x = _rows(m, 300, torch.float16, seed=m)
    w, ws, b = _weight(40, 300, torch.float16, seed=7)
    got = int8_gemm.w8a8_decode(x, w, ws, b, block_n=16, block_k=64, prequantize=True)
    assert torch.equal(got, w8a8_linear(x, w, ws, b, act_symmetric=True))


@pytest.mark.parametrize("block_m", [4, 16])
def test_row_tile_wider_than_the_rows(block_m):
    # Rows past M are masked (a zero row, eps scale) and add nothing; nothing is stored for them.
    x = _rows(3, 300, torch.float16, seed=5)
    w, ws, b = _weight(40, 300, torch.float16, seed=6)
    got = int8_gemm.w8a8_decode(x, w, ws.view(-1), b, block_m=block_m, block_n=32, block_k=128)
    assert torch.equal(got, w8a8_linear(x, w, ws, b, act_symmetric=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,block_m", [(17, 16), (70, 32)])  # ragged row tiles: 2 tiles - 15, 3 tiles - 26
def test_row_tiles_are_bit_exact(dtype, m, block_m):
    x = _rows(m, 200, dtype, seed=m)
    w, ws, b = _weight(50, 200, dtype, seed=3)
    cfg = int8_gemm.TileConfig(block_m, 16, 64, 4, 2)  # N: 3 tiles + 2, K: 3 steps + 8
    got = int8_gemm.w8a8_tiles(x, w, ws, b, config=cfg)
    assert got.shape == (m, 50) and got.dtype == dtype
    assert torch.equal(got, w8a8_linear(x, w, ws, b, act_symmetric=True))
    assert torch.equal(int8_gemm.w8a8_tiles(x, w, ws.view(-1), None, config=cfg),
                       w8a8_linear(x, w, ws, None, act_symmetric=True))
    with pytest.raises(ValueError, match="block_k >= 32"):
        int8_gemm.w8a8_tiles(x, w, ws, b, config=int8_gemm.TileConfig(16, 16, 16, 4, 2))


@pytest.mark.parametrize("split_k", [2, 3, 7])  # 7: more splits than K steps (5) -> 5 splits of one step
def test_split_input_tiles_are_bit_exact(split_k, monkeypatch):
    """K in several programs a tile: int32 partial tiles summed in the launch by the last split to finish, the same
    bits as one program a tile, and the tile counts left at zero for the next launch; with no count buffer (a first
    call inside a CUDA-graph capture) one program a tile."""
    from pagedllm.kernels import launch

    x = _rows(40, 300, torch.float16, seed=11)
    w, ws, b = _weight(50, 300, torch.float16, seed=12)
    cfg = int8_gemm.TileConfig(32, 16, 64, 4, 2, split_k)  # 2 x 4 tiles, K: 4 steps + 44
    want = w8a8_linear(x, w, ws, b, act_symmetric=True)
    assert torch.equal(int8_gemm.w8a8_tiles(x, w, ws, b, config=cfg), want)
    assert not launch.split_counts(x.device, 8).any()
    monkeypatch.setattr(launch, "split_counts", lambda device, tiles: None)
    assert torch.equal(int8_gemm.w8a8_tiles(x, w, ws, b, config=cfg), want)
    with pytest.raises(ValueError, match="split_k >= 1"):
        int8_gemm.w8a8_tiles(x, w, ws, b, config=int8_gemm.TileConfig(32, 16, 64, 4, 2, 0))


def test_bfloat16_matches_the_two_launch_kernels():
    # The interpreter casts float32 to bfloat16 by truncation (torch and compiled code round to nearest), so
    # bfloat16 is checked here against int8_quant's kernels, which share that cast; on a GPU, test_int8_gpu.py.
    x = _rows(5, 500, torch.bfloat16, seed=9)
    w, ws, b = _weight(70, 500, torch.bfloat16, seed=10)
    xq, xs = int8_quant.quantize_rows(x)
    want = int8_quant.scale_rows(torch._int_mm(xq, w.t()), xs, ws, b, torch.bfloat16)
    assert torch.equal(int8_gemm.w8a8_decode(x, w, ws, b), want)


def test_default_tiles_are_valid():
    # Rows rounded up to a power of two (never a wasted 16-row tile for one row), the int8 dot's shortest K.
    for m, n, k in [(1, 4096, 4096), (7, 6144, 4096), (16, 4096, 14336), (3, 28672, 4096), (1, 64, 20)]:
        cfg = int8_gemm.default_config(m, n, k)
        int8_gemm._check_config(cfg, m)
        assert cfg.block_m == max(1, 1 << (m - 1).bit_length()) and cfg.block_k >= 32


def test_row_tiles_fit_the_shared_memory():
    # Hopper: 128 x 128 tiles, or 64 columns where 128 would leave SMs idle, long inputs then split in two; a
    # consumer GPU's 99 KB: two stages.
    assert int8_gemm.tile_config(1024, 28672, 4096) == int8_gemm.TileConfig(128, 128, 128, 4, 3)
    assert int8_gemm.tile_config(256, 4096, 14336) == int8_gemm.TileConfig(128, 64, 128, 4, 4, 2)
    assert int8_gemm.tile_config(80, 6144, 4096) == int8_gemm.TileConfig(128, 64, 128, 4, 4)
    for m, n in [(1024, 28672), (256, 4096)]:
        cfg = int8_gemm.tile_config(m, n, 4096, shared_memory=99 * 1024)
        assert cfg.num_stages == 2 and cfg.num_stages * (cfg.block_m + cfg.block_n) * cfg.block_k <= 99 * 1024


def test_more_than_sixteen_rows_is_refused():
    x = torch.zeros(17, 64)
    w, ws, _ = _weight(32, 64, torch.float32, seed=0)
    with pytest.raises(ValueError, match="17 rows"):
        int8_gemm.w8a8_decode(x, w, ws)


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda x, w, ws, b: (x, w.float(), ws, b), "weight"),
        (lambda x, w, ws, b: (x, w[:, :32].contiguous(), ws, b), "weight"),
        (lambda x, w, ws, b: (x.to(torch.int32), w, ws, b), "x"),
        (lambda x, w, ws, b: (x, w, ws.half(), b), "weight_scale"),
        (lambda x, w, ws, b: (x, w, ws[:8], b), "weight_scale"),
        (lambda x, w, ws, b: (x, w, ws, b[:8]), "bias"),
    ],
)
def test_mismatched_arguments_are_refused(change, match):
    x = torch.zeros(2, 64)
    w, ws, b = _weight(16, 64, torch.float32, seed=0)
    with pytest.raises(ValueError, match=match):
        int8_gemm.w8a8_decode(*change(x, w, ws, b))


def test_cpu_tensors_keep_the_torch_path():
    x = torch.zeros(2, 64)
    w, _, _ = _weight(16, 64, torch.float32, seed=0)
    assert not int8_gemm.usable(x, w)


@pytest.mark.parametrize("m,split_k", [(1, 1), (3, 3), (16, 1)])
def test_asymmetric_rows_in_the_decode_kernel(m, split_k):
    # Rows quantized with a zero point each in their own launch; the epilogue takes zero x row sum off first.
    from test_int8_triton import _skewed_rows

    x = _skewed_rows(m, 300, torch.float16, seed=m)
    w, ws, b = _weight(40, 300, torch.float16, seed=13)
    sums = w.sum(dim=1, dtype=torch.int32).float()
    want = w8a8_linear(x, w, ws, b, act_symmetric=False)  # on CPU: quantize_int8_rows, the int32 product, torch ops
    got = int8_gemm.w8a8_decode(x, w, ws, b, block_n=16, block_k=64, split_k=split_k, weight_row_sums=sums)
    assert torch.equal(got, want)
    tiles = int8_gemm.w8a8_tiles(x, w, ws, b, config=int8_gemm.TileConfig(16, 16, 64, 4, 2, 2), weight_row_sums=sums)
    assert torch.equal(tiles, want)
    assert torch.equal(w8a8_linear(x, w, ws, b, act_symmetric=False, row_sums=sums), want)
    with pytest.raises(ValueError, match=r"weight_row_sums: \[40\] float32"):
        int8_gemm.w8a8_decode(x, w, ws, b, weight_row_sums=sums[:8])


def test_asymmetric_activations_keep_their_weight_row_sums():
    from pagedllm.layers.linear import ColumnParallelLinear
    from pagedllm.layers.quantization.int8 import W8A8Int8LinearMethod

    layer = ColumnParallelLinear(64, 32, bias=False, quant_method=W8A8Int8LinearMethod("asymmetric"))
    layer.weight.data = torch.randint(-128, 128, (32, 64), generator=torch.Generator().manual_seed(1),
                                      dtype=torch.int8)
    layer.weight_scale.data = torch.rand(32, 1) * 1e-2
    layer.quant_method.process_weights_after_loading(layer)
    assert torch.equal(layer.weight_row_sums, layer.weight.sum(dim=1, dtype=torch.int32).float())
    assert "weight_row_sums" not in dict(layer.named_parameters())
    x = torch.randn(5, 64)
    assert torch.equal(layer(x), w8a8_linear(x, layer.weight, layer.weight_scale, None, act_symmetric=False))
