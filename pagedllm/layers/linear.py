"""Linear layers in vLLM's tensor-parallel shapes; each weight_loader takes its shard of a checkpoint tensor.

A layer built without ``tp_rank``/``tp_size`` takes them from the current tensor-parallel group
(``distributed.get_tp_group()``; a group of one in a single process), so models need no change:
column-parallel layers split their output dimension, row-parallel layers their input dimension (and
all-reduce their partial sums), and fused layers (QKV, gate/up) load each logical checkpoint tensor
into its slice of the fused parameter. Loaders narrow a checkpoint tensor to the rank's rows before
copying, so a lazily read tensor is read only in that part.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.parallel_state import get_tp_group
from pagedllm.layers.cpu_linear import PackedWeight, cpu_linear

ShardId = int | str | None


class LinearMethodBase:
    """How a linear layer owns and applies its weights: the hook a quantization scheme replaces."""

    def create_weights(
        self, layer: nn.Module, input_size: int, output_size: int, bias: bool, params_dtype: torch.dtype
    ) -> None:
        raise NotImplementedError

    def apply(
        self,
        layer: nn.Module,
        x: torch.Tensor,  # [T, input_size]
        bias: torch.Tensor | None,
    ) -> torch.Tensor:  # [T, output_size]
        raise NotImplementedError

    def quantized_input(self, layer: nn.Module) -> str | None:
        """The kind of rows ("fp8", "int8") this method quantizes its input to, which the kernel that alone produces
        that input may hand over already quantized (``layers/quantization/fused_rows.py``); None: it takes the rows
        as they are."""
        return None


class UnquantizedLinearMethod(LinearMethodBase):
    def create_weights(
        self, layer: nn.Module, input_size: int, output_size: int, bias: bool, params_dtype: torch.dtype
    ) -> None:
        # Empty, not initialized: every parameter is overwritten by a checkpoint or the dummy loader.
        layer.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=params_dtype), requires_grad=False)
        layer.weight.weight_loader = layer.weight_loader
        if bias:
            layer.bias = nn.Parameter(torch.empty(output_size, dtype=params_dtype), requires_grad=False)
            layer.bias.weight_loader = layer.weight_loader
        else:
            layer.register_parameter("bias", None)

        # The weight in oneDNN's layout, made on the first CPU product (cpu_linear.py).
        layer.packed_weight = PackedWeight()

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.device.type == "cpu":
            return cpu_linear(x, layer.weight, bias, layer.packed_weight)
        if x.shape[0] == 1 and x.is_cuda:
            from pagedllm.kernels import gemv

            if gemv.usable(x, layer.weight):
                # One token (batch-1 decode): one bandwidth-bound launch instead of cuBLAS's split-K pair.
                return gemv.gemv(x, layer.weight, bias)
        return F.linear(x, layer.weight, bias)


# The method of linears built without an explicit one: set while a quantized checkpoint's model is built.
_DEFAULT_METHOD: ContextVar[Callable[[], LinearMethodBase] | None] = ContextVar("pagedllm_linear_method", default=None)


@contextmanager
def default_linear_method(factory: Callable[[], LinearMethodBase]) -> Iterator[None]:
    """Linear layers constructed inside take ``factory()`` as their method (a checkpoint stored quantized)."""
    token = _DEFAULT_METHOD.set(factory)
    try:
        yield
    finally:
        _DEFAULT_METHOD.reset(token)


def current_default_method() -> LinearMethodBase | None:
    """The method linears built now would take by default (a quantized checkpoint's), or None."""
    factory = _DEFAULT_METHOD.get()
    return None if factory is None else factory()


def _copy_checked(param: torch.Tensor, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(
            f"shape mismatch loading weight: parameter {tuple(param.shape)}, checkpoint {tuple(loaded.shape)}"
        )
    param.copy_(loaded)


def _tp_slice(loaded: torch.Tensor, dim: int, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This rank's equal share of ``loaded`` along ``dim``."""
    if tp_size == 1:
        return loaded
    size = loaded.shape[dim] // tp_size
    return loaded.narrow(dim, tp_rank * size, size)


class LinearBase(nn.Module):
    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        params_dtype: torch.dtype | None = None,
        quant_method: LinearMethodBase | None = None,
        tp_rank: int | None = None,
        tp_size: int | None = None,
    ) -> None:
        super().__init__()
        group = get_tp_group()
        self.tp_group = group
        self.input_size = input_size
        self.output_size = output_size
        self.params_dtype = params_dtype or torch.get_default_dtype()
        factory = _DEFAULT_METHOD.get()
        self.quant_method = quant_method or (factory() if factory is not None else UnquantizedLinearMethod())
        self.tp_rank = group.rank_in_group if tp_rank is None else tp_rank
        self.tp_size = group.world_size if tp_size is None else tp_size

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None) -> None:
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}, tp={self.tp_size}"


class ReplicatedLinear(LinearBase):
    """The full weight on every rank."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, **kwargs) -> None:
        super().__init__(input_size, output_size, bias, **kwargs)
        self.quant_method.create_weights(self, input_size, output_size, bias, self.params_dtype)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None) -> None:
        _copy_checked(param.data, loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        return self.quant_method.apply(self, x, self.bias)


class ColumnParallelLinear(LinearBase):
    """Y = X A^T with A split by output rows: each rank computes its slice of Y."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool = True, gather_output: bool = False, **kwargs
    ) -> None:
        super().__init__(input_size, output_size, bias, **kwargs)
        if output_size % self.tp_size:
            raise ValueError(f"output size {output_size} is not divisible by tensor parallel size {self.tp_size}")
        self.gather_output = gather_output
        self.output_size_per_partition = output_size // self.tp_size
        self.quant_method.create_weights(self, input_size, self.output_size_per_partition, bias, self.params_dtype)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None) -> None:
        _copy_checked(param.data, _tp_slice(loaded_weight, 0, self.tp_rank, self.tp_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out / tp] (or [T, out] if gathered)
        y = self.quant_method.apply(self, x, self.bias)
        if self.gather_output and self.tp_size > 1:
            y = self.tp_group.all_gather(y, dim=-1)
        return y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input fused into one matmul (e.g. gate and up).

    Each rank's parameter is the concatenation of its slice of every projection, so a logical
    checkpoint tensor (``shard_id`` = its index) lands in its own sub-block; a checkpoint that is
    already fused (``shard_id=None``, e.g. Phi-3's gate_up_proj) is split and loaded piece by piece.
    """

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool = True, **kwargs) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(self.output_sizes), bias, **kwargs)
        if any(s % self.tp_size for s in self.output_sizes):
            raise ValueError(f"output sizes {self.output_sizes} do not divide by tensor parallel size {self.tp_size}")

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None) -> None:
        if shard_id is None:
            for i, piece in enumerate(loaded_weight.split(self.output_sizes, dim=0)):
                self.weight_loader(param, piece, i)
            return
        assert isinstance(shard_id, int)
        size = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        dst = param.data.narrow(0, offset, size)
        _copy_checked(dst, _tp_slice(loaded_weight, 0, self.tp_rank, self.tp_size))


class QKVParallelLinear(ColumnParallelLinear):
    """The fused Q, K, V projection of attention; shards are ``"q"``, ``"k"``, ``"v"``.

    With more ranks than KV heads each rank keeps one KV head, replicated across the ranks
    whose query heads share it.
    """

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int | None = None,
        bias: bool = False,
        **kwargs,
    ) -> None:
        tp_size = kwargs.get("tp_size")
        if tp_size is None:
            tp_size = get_tp_group().world_size
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads or total_num_heads
        if total_num_heads % tp_size:
            raise ValueError(f"{total_num_heads} query heads are not divisible by tensor parallel size {tp_size}")
        self.num_heads = total_num_heads // tp_size
        if tp_size >= self.total_num_kv_heads:
            if tp_size % self.total_num_kv_heads:
                raise ValueError(f"tensor parallel size {tp_size} is no multiple of {self.total_num_kv_heads} KV heads")
            self.num_kv_heads, self.num_kv_head_replicas = 1, tp_size // self.total_num_kv_heads
        else:
            if self.total_num_kv_heads % tp_size:
                raise ValueError(f"{self.total_num_kv_heads} KV heads do not divide by tensor parallel size {tp_size}")
            self.num_kv_heads, self.num_kv_head_replicas = self.total_num_kv_heads // tp_size, 1
        # The full (unsharded) size the base class divides by tp_size to get this rank's rows.
        output_size = (self.num_heads + 2 * self.num_kv_heads) * tp_size * head_size
        super().__init__(hidden_size, output_size, bias, **kwargs)
        self.q_size = self.num_heads * head_size
        self.kv_size = self.num_kv_heads * head_size

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None) -> None:
        if shard_id is None:
            d = self.head_size
            sizes = [self.total_num_heads * d, self.total_num_kv_heads * d, self.total_num_kv_heads * d]
            for sid, piece in zip("qkv", loaded_weight.split(sizes, dim=0)):
                self.weight_loader(param, piece, sid)
            return
        if shard_id == "q":
            offset, size, rank = 0, self.q_size, self.tp_rank
        elif shard_id in ("k", "v"):
            offset = self.q_size + (self.kv_size if shard_id == "v" else 0)
            size, rank = self.kv_size, self.tp_rank // self.num_kv_head_replicas
        else:
            raise ValueError(f"QKV shard id must be 'q', 'k' or 'v', got {shard_id!r}")
        src = loaded_weight.narrow(0, rank * size, size)
        _copy_checked(param.data.narrow(0, offset, size), src)

    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[T, q + 2 kv] -> q [T, Hq*D], k [T, Hkv*D], v [T, Hkv*D] of this rank."""
        return qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)


class RowParallelLinear(LinearBase):
    """Y = X A^T with A split by input columns: each rank holds a partial sum, reduced across ranks."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        input_is_parallel: bool = True,
        reduce_results: bool = True,
        **kwargs,
    ) -> None:
        super().__init__(input_size, output_size, bias, **kwargs)
        if input_size % self.tp_size:
            raise ValueError(f"input size {input_size} is not divisible by tensor parallel size {self.tp_size}")
        self.input_is_parallel = input_is_parallel
        self.reduce_results = reduce_results
        self.input_size_per_partition = input_size // self.tp_size
        self.quant_method.create_weights(self, self.input_size_per_partition, output_size, bias, self.params_dtype)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None) -> None:
        # The bias is added once, after the reduction, so every rank keeps it whole.
        dim = 1 if param.dim() == 2 else None
        src = loaded_weight if dim is None else _tp_slice(loaded_weight, dim, self.tp_rank, self.tp_size)
        _copy_checked(param.data, src)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in / tp] -> [T, out]
        if self.tp_size == 1:
            return self.quant_method.apply(self, x, self.bias)
        if not self.input_is_parallel:
            x = x.chunk(self.tp_size, dim=-1)[self.tp_rank]
        y = self.quant_method.apply(self, x, None)
        if self.reduce_results:
            self.tp_group.all_reduce(y)
        if self.bias is not None:
            y = y + self.bias
        return y
