"""The Triton GEMV (one token) and the skinny GEMM (2-64 tokens, float8 weights) against torch's product, interpreted on CPU in fp16."""
from __future__ import annotations


import pytest
import torch

_ON_GPU = torch.cuda.is_available()  # without a GPU, conftest.py runs the kernels interpreted

triton = pytest.importorskip("triton", reason="triton is not importable; the GEMV kernel cannot be tested")

from pagedllm.kernels import gemv as gemv_k  # noqa: E402
from pagedllm.kernels import skinny_gemm as sg_k  # noqa: E402
from pagedllm.layers.quantization.fp8 import quantize_rows_ref  # noqa: E402


pytestmark = [pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")]

DEVICE = "cuda" if _ON_GPU else "cpu"
DTYPES = [torch.float16] + ([torch.bfloat16] if _ON_GPU else [])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "k", "bias"), [(64, 512, False), (48, 1024, True), (96, 768, False), (32, 384, True)])
def test_gemv_matches_fp32_product(n: int, k: int, bias: bool, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(n * k)
    x = torch.randn(1, k, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=gen) * k**-0.5).to(DEVICE, dtype)
    b = torch.randn(n, generator=gen).to(DEVICE, dtype) if bias else None
    assert gemv_k.usable(x, w) == _ON_GPU  # CUDA only in the engine; the kernel itself runs interpreted here
    y = gemv_k.gemv(x, w, b)
    ref = x.float() @ w.float().T + (b.float() if bias else 0.0)
    assert y.shape == (1, n) and y.dtype == dtype
    # fp32 accumulation, one rounding of the output: within one half-type ulp of |y| <= ~4.
    atol = 4e-3 if dtype == torch.float16 else 3e-2
    torch.testing.assert_close(y.float(), ref, atol=atol, rtol=0)


@pytest.mark.parametrize("config", [gemv_k.GemvConfig(4, 128, 4), gemv_k.GemvConfig(16, 256, 8),
                                    gemv_k.GemvConfig(2, 512, 4)])
def test_gemv_tile_shapes_agree(config: gemv_k.GemvConfig) -> None:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(1, 1024, generator=gen).to(DEVICE, torch.float16)
    w = (torch.randn(64, 1024, generator=gen) * 0.03).to(DEVICE, torch.float16)
    ref = gemv_k.gemv(x, w)
    torch.testing.assert_close(gemv_k.gemv(x, w, config=config).float(), ref.float(), atol=4e-3, rtol=0)


def test_config_covers_model_shapes_and_refuses_odd_ones() -> None:
    for n, k in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096), (151936, 1024),
                 (1024, 3072), (6144, 1024)]:
        for float8 in (False, True):
            cfg = gemv_k.default_config(n, k, float8)
            assert cfg is not None and n % cfg.block_n == 0 and k % cfg.block_k == 0 and cfg.block_k % gemv_k.FOLD == 0
    # Float8 rows carry half the bytes a column: taller or wider tiles than 16-bit ones (the H200 tile sweep).
    assert gemv_k.default_config(4096, 4096) == gemv_k.GemvConfig(2, 2048, 4)
    assert gemv_k.default_config(28672, 4096, float8=True) == gemv_k.GemvConfig(16, 512, 4)
    assert gemv_k.default_config(6144, 4096, float8=True) == gemv_k.GemvConfig(8, 1024, 4)
    assert gemv_k.default_config(4096, 14336, float8=True) == gemv_k.GemvConfig(4, 2048, 4)
    assert gemv_k.default_config(1024, 3072, float8=True).block_k == 1024  # 2048 does not divide 3072
    assert gemv_k.default_config(4096, 100) is None  # no K tile divides 100
    assert gemv_k.default_config(4097, 4096) is None  # no N tile divides 4097
    x = torch.zeros(2, 512, dtype=torch.float16)
    assert not gemv_k.usable(x, torch.zeros(64, 512, dtype=torch.float16))  # two tokens: not a GEMV


def _float8_weight(n: int, k: int, gen: torch.Generator, std: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A float8 weight [n, k] on DEVICE and its float32 row scales [n]."""
    w_q, w_s = quantize_rows_ref(torch.randn(n, k, generator=gen) * std)
    return w_q.to(DEVICE), w_s.reshape(-1).to(DEVICE)


def _reference(x: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    return (x.float() @ w_q.float().T) * w_s[None, :] + (b.float() if b is not None else 0.0)


@pytest.mark.parametrize("m", [2, 5, 16, 33])
@pytest.mark.parametrize(("n", "k", "bias"), [(64, 256, False), (96, 128, True)])
def test_skinny_gemm_matches_fp32_product(m: int, n: int, k: int, bias: bool) -> None:
    # 64 x 256 takes the float8 tiles; K = 128 is too shallow for them and takes the general ones.
    gen = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=gen).to(DEVICE, torch.float16)
    w, s = _float8_weight(n, k, gen, k**-0.5)
    b = torch.randn(n, generator=gen).to(DEVICE, torch.float16) if bias else None
    assert sg_k.default_config(m, n, k) is not None
    y = sg_k.skinny_gemm(x, w, b, scale=s)
    assert y.shape == (m, n) and y.dtype == torch.float16
    torch.testing.assert_close(y.float(), _reference(x, w, s, b), atol=4e-3, rtol=2e-3)


@pytest.mark.parametrize("config", [sg_k.GemmConfig(16, 32, 32, 4, 2), sg_k.GemmConfig(32, 64, 64, 4, 3),
                                    sg_k.GemmConfig(16, 64, 64, 4, 2, swap_ab=True),
                                    sg_k.GemmConfig(64, 128, 32, 4, 3, 2, swap_ab=True)])
def test_skinny_gemm_tiles_agree(config) -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(40, 256, generator=gen).to(DEVICE, torch.float16)
    w, s = _float8_weight(128, 256, gen, 0.06)
    torch.testing.assert_close(sg_k.skinny_gemm(x, w, config=config, scale=s).float(), _reference(x, w, s),
                               atol=4e-3, rtol=2e-3)


def test_skinny_gemm_configs_and_limits() -> None:
    assert sg_k.default_config(sg_k.MAX_ROWS + 1, 1024, 1024) is None  # past MAX_ROWS: cuBLAS
    assert sg_k.default_config(64, 1024, 100) is None  # no K step divides 100
    for m, n, k in [(64, 1024, 2048), (64, 4096, 1152), (16, 6144, 1024), (33, 1000 - 8, 3072)]:
        cfg = sg_k.default_config(m, n, k)
        assert cfg is not None and n % cfg.block_n == 0 and k % cfg.block_k == 0 and cfg.block_m >= 16
    x = torch.zeros(1, 256, dtype=torch.float16)
    assert not sg_k.usable(x, torch.zeros(64, 256, dtype=torch.float8_e4m3fn))  # one token: the GEMV's case
    x = torch.zeros(8, 256, dtype=torch.float16)
    assert not sg_k.usable(x, torch.zeros(64, 256, dtype=torch.float16))  # a 16-bit weight: cuBLAS


@pytest.mark.parametrize(("m", "n", "k", "split", "bias"), [(5, 64, 256, 2, False), (40, 96, 512, 4, True), (16, 32, 1024, 8, True)])
def test_split_k_matches_fp32_product(m: int, n: int, k: int, split: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(m, k, generator=gen).to(DEVICE, torch.float16)
    w, s = _float8_weight(n, k, gen, k**-0.5)
    b = torch.randn(n, generator=gen).to(DEVICE, torch.float16) if bias else None
    cfg = sg_k.GemmConfig(16 if m <= 16 else 32, 32, 64, 4, 2, split)
    y = sg_k.skinny_gemm(x, w, b, config=cfg, scale=s)
    torch.testing.assert_close(y.float(), _reference(x, w, s, b), atol=4e-3, rtol=2e-3)


def test_split_k_sums_in_split_order_whoever_arrives_last() -> None:
    """The same bits on every call, whatever partials the workspace held before, and the tile counters
    back at zero after each launch (a stale count would make the wrong program sum the tile)."""
    m, n, k = (64, 1024, 2048) if _ON_GPU else (33, 64, 512)
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(m, k, generator=gen).to(DEVICE, torch.float16)
    w, s = _float8_weight(n, k, gen, k**-0.5)
    cfg = sg_k.GemmConfig(32, 32, 64, 4, 2, 4)
    first = sg_k.skinny_gemm(x, w, config=cfg, scale=s)
    parts, counts = sg_k._workspace(x.device)
    for _ in range(20 if _ON_GPU else 2):
        parts.fill_(float("nan"))
        assert torch.equal(sg_k.skinny_gemm(x, w, config=cfg, scale=s), first)
        assert int(counts.abs().sum()) == 0
    torch.testing.assert_close(first.float(), _reference(x, w, s), atol=4e-3, rtol=2e-3)


def test_general_tiles_for_inputs_the_float8_tiles_do_not_divide() -> None:
    # K not a multiple of 256: the general tiles, the deepest K step dividing it, never split.
    assert sg_k.default_config(16, 1024, 3200) == sg_k.GemmConfig(16, 32, 128, 4, 3)
    assert sg_k.default_config(64, 4096, 1120) == sg_k.GemmConfig(64, 32, 32, 4, 3)
    assert sg_k.default_config(16, 1024, 3072).block_k == 256  # a multiple of 256: the float8 tiles
