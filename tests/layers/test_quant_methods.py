"""The quantization-method interface without a model: configs refused by field, the packed layouts against an
independent reader, each method's tensor-parallel split, and the int8 product against its dequantized form."""
from __future__ import annotations

import pytest
import torch

from pagedllm.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedllm.layers.quantization.awq import AWQLinearMethod
from pagedllm.layers.quantization.compressed_tensors import PackedWeightOnlyLinearMethod
from pagedllm.layers.quantization.fp8_block import Fp8BlockLinearMethod
from pagedllm.layers.quantization.gptq import GPTQLinearMethod
from pagedllm.layers.quantization.int8 import W8A8Int8LinearMethod, quantize_int8_rows, w8a8_linear
from pagedllm.layers.quantization.registry import parse_quantization_config
from pagedllm.layers.quantization.unpack import pack_int32, unpack_int32

_CT_W4 = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
    "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                       "group_size": 128}}}}


_CT_ROTATED = {**_CT_W4, "transform_config": {"config_groups": {"v": {
    "type": "random-hadamard", "apply": [{"targets": ["Linear"], "location": "input", "ignore": ["lm_head"]}]}}}}


def _with(cfg: dict, path: str, value) -> dict:
    import copy

    cfg = copy.deepcopy(cfg)
    node = cfg
    *parents, leaf = path.split(".")
    for key in parents:
        node = node[key]
    node[leaf] = value
    return cfg


@pytest.mark.parametrize(("cfg", "message"), [
    ({"quant_method": "awq", "bits": 3, "group_size": 128}, "awq.*bits 3.*supported: 4"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "version 'gemv'"),
    ({"quant_method": "awq", "bits": 4, "group_size": 0}, "group_size 0"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "gptq.*bits 3.*2, 4, 8"),
    ({"quant_method": "gptq", "bits": 4, "group_size": -2}, "group_size -2"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"}, "activation_scheme 'static'"),
    (_with(_CT_W4, "config_groups.group_0.weights.num_bits", 2), "weights.num_bits 2"),
    (_with(_CT_W4, "config_groups.group_0.weights.strategy", "tensor"), "weights.strategy 'tensor'"),
    (_with(_CT_W4, "config_groups.group_0.weights.actorder", "group"), "weights.actorder 'group'"),
    (_with(_CT_W4, "config_groups.group_0.targets", ["Embedding"]), "targets \\['Embedding'\\]"),
    (_with(_CT_W4, "format", "marlin-24"), "format 'marlin-24'"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "dynamic": {"+:.*down_proj": {"bits": 8}}},
     r"gptq.*dynamic\['\+:\.\*down_proj'\] \{'bits': 8\}"),
    (_with(_CT_ROTATED, "transform_config.config_groups.v.type", "fancy"),
     r"transform_config\.config_groups\['v'\]\.type 'fancy'.*hadamard, random-hadamard, random-matrix"),
    (_with(_CT_ROTATED, "transform_config.config_groups.v.apply", [{"targets": ["Linear"], "location": "k_cache"}]),
     r"config_groups\['v'\]\.apply\[0\]\.location 'k_cache'"),
    (_with(_CT_ROTATED, "transform_config.config_groups.v.head_dim", 0), r"config_groups\['v'\]\.head_dim 0"),
    (_with(_CT_ROTATED, "transform_config.config_groups.v.precision", "torch.int8"), r"precision 'torch\.int8'"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, "modelopt.*quant_algo 'NVFP4'.*'FP8', 'FP8_PER_CHANNEL"),
    ({"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_quant_algo": "NVFP4"}, "kv_cache_quant_algo 'NVFP4'"),
])
def test_inconsistent_configs_are_refused_naming_field_and_value(cfg: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_quantization_config(cfg)


def test_unknown_method_names_the_supported_list() -> None:
    with pytest.raises(NotImplementedError, match="'hqq'.*awq, compressed-tensors, fp8, gguf, gptq.*fp8, int8"):
        parse_quantization_config({"quant_method": "hqq"})


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dim", [0, 1])
def test_word_layout_agrees_with_compressed_tensors_reader(bits: int, dim: int) -> None:
    """GPTQ and compressed-tensors put value i of a word in bits [i*b, (i+1)*b); compressed-tensors' own unpacking
    (which offsets values by 2**(b-1)) reads the words ``pack_int32`` writes."""
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    gen = torch.Generator().manual_seed(0)
    values = torch.randint(0, 2**bits, (64, 48), generator=gen, dtype=torch.int32)
    packed = pack_int32(values, bits, dim)
    theirs = helpers.unpack_from_int32(packed, bits, values.shape, packed_dim=dim).int() + 2 ** (bits - 1)
    assert torch.equal(theirs, values)
    assert torch.equal(unpack_int32(packed, bits, dim), values)


def _fill(layer, gen) -> None:
    for p in layer.parameters():
        if p.dtype == torch.int32:
            p.data = torch.randint(-2**31, 2**31 - 1, p.shape, generator=gen, dtype=torch.int64).to(torch.int32)
        elif p.dtype == torch.int8:
            p.data = torch.randint(-128, 128, p.shape, generator=gen, dtype=torch.int8)
        elif p.dtype == torch.float8_e4m3fn:
            p.data = torch.randn(p.shape, generator=gen).to(torch.float8_e4m3fn)
        else:
            p.data = torch.rand(p.shape, generator=gen) + 0.5


_METHODS = {
    "awq": lambda: AWQLinearMethod(64),
    "gptq": lambda: GPTQLinearMethod(4, 64, desc_act=False, zero_offset=1),
    "gptq-act-order": lambda: GPTQLinearMethod(4, 64, desc_act=True, zero_offset=1),
    "gptq-8bit-one-group": lambda: GPTQLinearMethod(8, -1, desc_act=False, zero_offset=0),
    "ct-w4a16-asym": lambda: PackedWeightOnlyLinearMethod(4, 64, symmetric=False),
    "ct-w8a8": lambda: W8A8Int8LinearMethod("symmetric"),
    "fp8-block": lambda: Fp8BlockLinearMethod((128, 128), "weight_scale_inv", 128),
}


def _load_full(layer, full: dict, shards=None) -> None:
    for name, tensor in full.items():
        param = getattr(layer, name)
        if shards is None:
            param.weight_loader(param, tensor)
        else:
            for sid, piece in shards(name, tensor):
                param.weight_loader(param, piece, sid)


@pytest.mark.parametrize("method", list(_METHODS))
@pytest.mark.parametrize("kind", ["column", "row", "qkv", "merged"])
def test_each_rank_dequantizes_its_slice_of_the_whole_weight(method: str, kind: str) -> None:
    """A method's stated split: rank r of 2 loads the whole checkpoint tensors and dequantizes exactly its rows
    (column-parallel, fused shards) or columns (row-parallel) of the whole weight."""
    k, n = 512, 512
    build = {
        "column": lambda **kw: ColumnParallelLinear(k, n, bias=False, **kw),
        "row": lambda **kw: RowParallelLinear(k, n, bias=False, **kw),
        "qkv": lambda **kw: QKVParallelLinear(k, 64, 4, 2, **kw),  # q 256, k/v 128: n = 512
        "merged": lambda **kw: MergedColumnParallelLinear(k, [256, 256], bias=False, **kw),
    }[kind]
    whole = build(quant_method=_METHODS[method]())
    _fill(whole, torch.Generator().manual_seed(1))
    if method == "gptq-act-order":
        whole.g_idx.data = torch.randperm(k, generator=torch.Generator().manual_seed(2)).int() // 64
    full = {name: p.data.clone() for name, p in whole.named_parameters()}  # the checkpoint, before any repacking
    whole.quant_method.process_weights_after_loading(whole)
    full_w = whole.quant_method.dequantize(whole)
    for rank in range(2):
        part = build(quant_method=_METHODS[method](), tp_rank=rank, tp_size=2)
        if method == "fp8-block" and kind == "qkv":
            # A rank's 64 rows of k or v split a 128-row block: refused, naming the unit.
            with pytest.raises(ValueError, match="weight_scale_inv.*64 channels is not a multiple of its 128"):
                _load_full(part, full)
            return
        _load_full(part, full)
        part.quant_method.process_weights_after_loading(part)
        got = part.quant_method.dequantize(part)
        if kind == "row":
            want = full_w[:, rank * k // 2:(rank + 1) * k // 2]
        elif kind == "qkv":
            q, kv = 256, 128
            rows = [range(rank * q // 2, (rank + 1) * q // 2), range(q + rank * kv // 2, q + (rank + 1) * kv // 2),
                    range(q + kv + rank * kv // 2, q + kv + (rank + 1) * kv // 2)]
            want = full_w[[i for r in rows for i in r]]
        elif kind == "merged":
            want = torch.cat([full_w[rank * 128:(rank + 1) * 128], full_w[256 + rank * 128:256 + (rank + 1) * 128]])
        else:
            want = full_w[rank * n // 2:(rank + 1) * n // 2]
        assert torch.equal(got, want), (method, kind, rank)


def test_shards_of_a_fused_layer_land_at_their_offsets() -> None:
    """q, k and v stored apart load into their places of the fused packed parameters (the whole fused tensor and its
    three pieces give the same layer)."""
    fused = QKVParallelLinear(256, 64, 4, 2, quant_method=GPTQLinearMethod(4, 64, desc_act=False, zero_offset=1))
    _fill(fused, torch.Generator().manual_seed(3))
    full = {name: p.data.clone() for name, p in fused.named_parameters()}
    pieces = QKVParallelLinear(256, 64, 4, 2, quant_method=GPTQLinearMethod(4, 64, desc_act=False, zero_offset=1))

    def shards(name, tensor):
        unit = 8 if name == "qzeros" else 1  # qzeros pack 8 outputs a word
        return zip("qkv", tensor.split([256 // unit, 128 // unit, 128 // unit], dim=1))

    _load_full(pieces, full, shards)
    for name, p in fused.named_parameters():
        assert torch.equal(getattr(pieces, name), p), name


@pytest.mark.parametrize("symmetric", [True, False])
def test_int8_product_equals_the_dequantized_product(symmetric: bool) -> None:
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(5, 96, generator=gen) + (0.0 if symmetric else 0.7)
    w = torch.randn(40, 96, generator=gen)
    wq, ws, _ = quantize_int8_rows(w)
    xq, xs, xz = quantize_int8_rows(x, symmetric)
    assert (xz is None) == symmetric
    xd = (xq.double() - (0 if xz is None else xz.double())) * xs.double()
    want = xd @ (wq.double() * ws.double()).t()
    got = w8a8_linear(x, wq, ws, None, symmetric)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    # and the quantized operands are close to the float ones
    torch.testing.assert_close(got, x @ w.t(), rtol=0.05, atol=0.3)


def test_modelopt_config_reads_its_exclusions_and_static_scales() -> None:
    """Model Optimizer names excluded modules exactly, by a parent module or with '*' patterns; its input scales are
    static, which pagedllm replaces by per-token scales (a note says so)."""
    from pagedllm.layers.quantization.registry import parse_quantization_config

    config = parse_quantization_config({"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_quant_algo": "FP8",
                                        "exclude_modules": ["lm_head", "model.layers.0", "*mlp.gate"]})
    assert config.engine_method == "fp8" and config.notes
    assert config.ignores("lm_head") and config.ignores("model.layers.0.self_attn.qkv_proj")
    assert config.ignores("model.layers.5.mlp.gate")
    assert not config.ignores("model.layers.5.mlp.gate_up_proj") and not config.ignores("model.layers.10.mlp.down_proj")
