"""GGUF checkpoints (quantization ``gguf``): linears, the embedding and the LM head keep llama.cpp's ggml blocks as
the file stores them and multiply through the CPU kernel (``kernels/cpu/gguf_gemm.py``) or, on a GPU, the Triton
kernel (``kernels/gguf_triton.py``, which reads fewer types: the rest are dequantized there).

A layer holds each tensor as uint8 rows of blocks [N, row_bytes] plus its ggml type, or, where no kernel reads
that type (or the device is not the CPU), the tensor dequantized at load, stored under the type F32. A fused
layer (QKV, gate/up) gets shards of different types from the file (llama.cpp's mixes put Q/K in Q5_0 and V in
Q8_0): adjacent shards of one type are concatenated into one segment, and each segment's product is written
into its slice of the output. Rows are output channels, so fused shards and column-parallel ranks take whole
rows; a row-parallel rank takes a slice of each row's blocks, which must start and end on a block boundary.

The loader (``model_loader/gguf_loader.py``) yields each matrix as two tensors, ``<module>.qweight_type`` (its
ggml type, a 0-dim integer tensor) then ``<module>.qweight`` (its rows), which these layers' loaders collect
per shard; ``finish_loading`` then lays the segments out.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels.cpu import gguf_gemm
from pagedllm.layers.quantization.gguf_dequant import dequantize as torch_dequantize
from pagedllm.layers.cpu_linear import PackedWeight, cpu_linear
from pagedllm.layers.quantization.base import QuantizationConfig, QuantizedLinearMethod
from pagedllm.layers.quantization.packed_params import _checkpoint_shards, _output_shard

F32 = 0  # ggml's type id of float32: a tensor dequantized at load is stored in this layout (in the model dtype)


def packed_kernel_available(device: torch.device | str) -> bool:
    """Whether GGUF tensors can stay packed on ``device``: a GPU (the Triton kernel), or the CPU with the compiled
    kernel usable here."""
    kind = torch.device(device).type
    return kind == "cuda" or (kind == "cpu" and gguf_gemm.available())


def keeps_packed(qtype: int, device: torch.device | str) -> bool:
    """Whether a tensor of ggml type ``qtype`` stays packed on ``device`` (else it is dequantized at load)."""
    if torch.device(device).type == "cuda":
        # Imported here: a CPU-only process never loads triton (~120 ms and ~47 MiB of resident memory).
        from pagedllm.kernels.gguf_triton import TRITON_TYPES as types
    else:
        types = gguf_gemm.KERNEL_TYPES
    return int(qtype) in types and packed_kernel_available(device)


def row_bytes(qtype: int, k: int) -> int:
    """Bytes of one packed row of ``k`` elements."""
    block, size = gguf_gemm.BLOCKS[int(qtype)]
    return k // block * size


class GGUFConfig(QuantizationConfig):
    """A GGUF file's matrices as stored; the types come per tensor from the file, not from a config."""

    name = engine_method = "gguf"

    def __init__(self, int8_activations: bool = False) -> None:
        self.int8_activations = int8_activations  # CPU decode products take 8-bit activations (gguf_gemm.gguf_mm)

    @classmethod
    def from_config(cls, cfg: dict) -> GGUFConfig:
        return cls()

    def linear_method(self) -> GGUFLinearMethod:
        return GGUFLinearMethod(self.int8_activations)

    def embedding_method(self) -> GGUFEmbeddingMethod:
        return GGUFEmbeddingMethod(self.int8_activations)


def _placeholders(layer: nn.Module, loaders, expected: tuple) -> None:
    """Empty ``qweight``/``qweight_type`` parameters that only receive the file's shards (``finish_loading``
    replaces them); each counts as loaded once every shard in ``expected`` has arrived."""
    layer.gguf_types, layer.gguf_shards = {}, {}
    for name, loader, seen in zip(("qweight_type", "qweight"), loaders, (layer.gguf_types, layer.gguf_shards)):
        param = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
        param.weight_loader = loader
        param.all_loaded = lambda seen=seen: all(s in seen for s in expected)
        param.gguf_layer = layer
        setattr(layer, name, param)


def _store(data: torch.Tensor) -> torch.Tensor:
    """A contiguous copy that owns its memory (file tensors are views of a read-only mapping)."""
    return data.clone(memory_format=torch.contiguous_format)


class GGUFLinearMethod(QuantizedLinearMethod):
    def __init__(self, int8_activations: bool = False) -> None:
        self.int8_activations = int8_activations

    def create_weights(
        self, layer: nn.Module, input_size: int, output_size: int, bias: bool, params_dtype: torch.dtype
    ) -> None:
        shards = _checkpoint_shards(layer)
        expected = tuple(sid for sid, _ in shards) if shards is not None else (None,)
        _placeholders(layer, (self._load_type, self._load_rows), expected)
        layer.gguf_input_size = input_size
        if bias:
            layer.bias = nn.Parameter(torch.empty(output_size, dtype=params_dtype), requires_grad=False)
            layer.bias.weight_loader = layer.weight_loader
        else:
            layer.register_parameter("bias", None)

    def _load_type(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        layer = param.gguf_layer
        shards = _checkpoint_shards(layer)
        ids = [sid for sid, _ in shards] if shard_id is None and shards is not None else [shard_id]
        for sid in ids:
            layer.gguf_types[sid] = int(loaded)

    def _load_rows(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:  # loaded [N, row_bytes]
        layer = param.gguf_layer
        shards = _checkpoint_shards(layer)
        if shard_id is None and shards is not None:  # a checkpoint tensor that is already fused
            for (sid, _), piece in zip(shards, loaded.split([n for _, n in shards], dim=0)):
                self._load_rows(param, piece, sid)
            return
        if shard_id not in layer.gguf_types:
            raise ValueError(f"gguf: rows of shard {shard_id!r} arrived before its qweight_type")
        qtype = layer.gguf_types[shard_id]
        out = _output_shard(layer, shard_id)
        if out is None:
            offset, size, src = 0, layer.output_size, loaded
        else:
            offset, size, rank = out
            if loaded.shape[0] < (rank + 1) * size:
                raise ValueError(f"gguf: shard {shard_id!r} has {loaded.shape[0]} rows; rank {rank} needs rows "
                                 f"{rank * size}..{(rank + 1) * size}")
            src = loaded.narrow(0, rank * size, size)
        k = layer.gguf_input_size
        if hasattr(layer, "input_size_per_partition") and layer.tp_size > 1:
            src = input_slice(src, qtype, k, layer.tp_rank, layer.input_size)
        width = k if qtype == F32 else row_bytes(qtype, k)
        if src.dim() != 2 or src.shape[0] != size or src.shape[1] != width:
            raise ValueError(f"gguf: shard {shard_id!r} of type {gguf_type_name(qtype)} has shape {tuple(src.shape)}; "
                             f"the layer takes ({size}, {width}) for {k} inputs")
        layer.gguf_shards[shard_id] = (offset, size, qtype, _store(src))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """The shards in output order, adjacent ones of one type concatenated into one segment each."""
        if not hasattr(layer, "gguf_shards"):
            return  # already laid out
        pieces = sorted(layer.gguf_shards.values(), key=lambda s: s[0])
        segments: list[list] = []  # [offset, size, qtype, [tensors]]
        for offset, size, qtype, data in pieces:
            if segments and segments[-1][2] == qtype and segments[-1][0] + segments[-1][1] == offset:
                segments[-1][1] += size
                segments[-1][3].append(data)
            else:
                segments.append([offset, size, qtype, [data]])
        for name in ("qweight", "qweight_type"):
            delattr(layer, name)
        del layer.gguf_shards, layer.gguf_types
        layer.gguf_segments = []
        layer.gguf_dense_packed = []
        for i, (offset, size, qtype, parts) in enumerate(segments):
            data = parts[0] if len(parts) == 1 else torch.cat(parts)
            if qtype == F32:
                data = data.to(layer.params_dtype)
            layer.register_buffer(f"qweight_{i}", data)
            layer.gguf_segments.append((offset, size, qtype))
            layer.gguf_dense_packed.append(PackedWeight() if qtype == F32 else None)

    def dequantize(self, layer: nn.Module) -> torch.Tensor:  # [N, K] float32
        return torch.cat([_dequantize(getattr(layer, f"qweight_{i}"), qtype)
                          for i, (_, _, qtype) in enumerate(layer.gguf_segments)])

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:  # [T, K] -> [T, N]
        segments = layer.gguf_segments
        if len(segments) == 1:
            y = _product(x, layer.qweight_0, segments[0][2], layer.gguf_dense_packed[0], self.int8_activations)
        else:
            n = sum(size for _, size, _ in segments)
            y = torch.empty(x.shape[0], n, dtype=torch.float32, device=x.device)
            for i, (offset, size, qtype) in enumerate(segments):
                y[:, offset : offset + size] = _product(x, getattr(layer, f"qweight_{i}"), qtype,
                                                        layer.gguf_dense_packed[i], self.int8_activations)
        if bias is not None:
            y = y + bias
        return y.to(x.dtype)


def input_slice(src: torch.Tensor, qtype: int, k: int, rank: int, full_k: int) -> torch.Tensor:
    """A row-parallel rank's ``k`` of ``full_k`` input channels out of full rows, on whole blocks only."""
    if qtype == F32:
        return src.narrow(1, rank * k, k)
    block, size = gguf_gemm.BLOCKS[qtype]
    if k % block:
        raise ValueError(f"gguf: a row-parallel rank's {k} of {full_k} input channels do not fall on block boundaries "
                         f"of {gguf_type_name(qtype)} ({block} channels a block); use a tensor parallel size that "
                         f"leaves each rank a multiple of {block} inputs, or --gguf-dequantize")
    return src.narrow(1, rank * (k // block) * size, (k // block) * size)


def _product(
    x: torch.Tensor, w: torch.Tensor, qtype: int, dense_packed: PackedWeight | None, int8_activations: bool = False
) -> torch.Tensor:
    """x [T, K] @ w.T -> [T, N] float32, w packed rows of ``qtype`` or (F32) a dense weight."""
    if qtype == F32:
        y = cpu_linear(x, w, None, dense_packed) if x.device.type == "cpu" else F.linear(x.to(w.dtype), w)
        return y.float()
    if w.device.type == "cuda":
        from pagedllm.kernels.gguf_triton import gguf_mm_triton

        return gguf_mm_triton(x, w, qtype)  # in x's dtype: the GPU keeps 16-bit activations
    return gguf_gemm.gguf_mm(x.float().contiguous(), w, qtype, int8_activations)


def _columns(w: torch.Tensor, qtype: int) -> int:
    block, size = gguf_gemm.BLOCKS[qtype]
    return w.shape[1] // size * block


def _dequantize(w: torch.Tensor, qtype: int) -> torch.Tensor:  # [N, row_bytes] -> [N, K] float32
    if qtype == F32:
        return w.float()
    if w.device.type != "cpu":
        return torch_dequantize(w, qtype, (w.shape[0], _columns(w, qtype)))
    return gguf_gemm.gguf_dequantize(w, qtype)


def _dequantize_rows(w: torch.Tensor, qtype: int, ids: torch.Tensor) -> torch.Tensor:  # ids [T] -> [T, K] float32
    if w.device.type != "cpu":
        return torch_dequantize(w.index_select(0, ids), qtype, (ids.numel(), _columns(w, qtype)))
    return gguf_gemm.gguf_dequantize_rows(w, qtype, ids)


def gguf_type_name(qtype: int) -> str:
    if qtype == F32:
        return "F32"
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(int(qtype)).name
    except ValueError:
        return f"ggml type {int(qtype)}"


class GGUFEmbeddingMethod:
    """The token embedding and the LM head (a vocabulary shard of rows each): the embedding decodes only the rows
    its tokens pick, the LM head multiplies through the kernel. A tied head reads the embedding's rows."""

    def __init__(self, int8_activations: bool = False) -> None:
        self.int8_activations = int8_activations

    def create_weights(self, layer: nn.Module) -> None:
        _placeholders(layer, (self._load_type, self._load_rows), (None,))

    def _load_type(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        param.gguf_layer.gguf_types[None] = int(loaded)

    def _load_rows(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:  # [V, row_bytes]
        layer = param.gguf_layer
        qtype = layer.gguf_types.get(None)
        if qtype is None:
            raise ValueError("gguf: embedding rows arrived before their qweight_type")
        width = layer.embedding_dim if qtype == F32 else row_bytes(qtype, layer.embedding_dim)
        if tuple(loaded.shape) != (layer.num_embeddings, width):
            raise ValueError(f"gguf: embedding of type {gguf_type_name(qtype)} has shape {tuple(loaded.shape)}; "
                             f"expected ({layer.num_embeddings}, {width}) for {layer.embedding_dim} channels")
        rows = layer.vocab_end - layer.vocab_start
        # Padding rows of the last vocabulary shard stay zero bytes, which every ggml type decodes to zeros.
        data = torch.zeros(layer.shard_size, width, dtype=loaded.dtype, device=loaded.device)
        data[:rows].copy_(loaded[layer.vocab_start : layer.vocab_end])
        layer.gguf_shards[None] = (0, layer.shard_size, qtype, data)

    def tie(self, head: nn.Module, embedding: nn.Module) -> None:
        """``head`` reads ``embedding``'s rows: its placeholders become the embedding's (loaded once)."""
        head.qweight, head.qweight_type = embedding.qweight, embedding.qweight_type
        head.gguf_tied_to = (embedding,)  # a tuple: not registered as a submodule

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if not hasattr(layer, "gguf_shards"):
            return
        tied = getattr(layer, "gguf_tied_to", None)
        if tied is not None:
            source = tied[0]
            source.quant_method.process_weights_after_loading(source)
            data, qtype = source.qweight_data, source.gguf_qtype
        else:
            _, _, qtype, data = layer.gguf_shards[None]
            if qtype == F32:
                data = data.to(layer.params_dtype)
        for name in ("qweight", "qweight_type"):
            delattr(layer, name)
        del layer.gguf_shards, layer.gguf_types
        layer.register_buffer("qweight_data", data)
        layer.gguf_qtype = qtype
        layer.gguf_dense_packed = PackedWeight() if qtype == F32 else None

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:  # [T] int64 (local) -> [T, E]
        if layer.gguf_qtype == F32:
            return F.embedding(ids, layer.qweight_data)
        return _dequantize_rows(layer.qweight_data, layer.gguf_qtype, ids).to(layer.params_dtype)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:  # [N, E] -> [N, V]
        y = _product(x, layer.qweight_data, layer.gguf_qtype, layer.gguf_dense_packed, self.int8_activations)
        return y if bias is None else y + bias


def finish_loading(model: nn.Module) -> None:
    """Lays out every GGUF layer's loaded shards (embeddings and linears)."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, (GGUFLinearMethod, GGUFEmbeddingMethod)):
            method.process_weights_after_loading(module)
