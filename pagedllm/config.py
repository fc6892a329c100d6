"""The frozen configuration tree (EngineConfig and its parts), built once from EngineArgs."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedllm.core.config import CacheConfig, SchedulerConfig
from pagedllm.graph_config import GraphConfig

if TYPE_CHECKING:
    import torch

_DTYPE_NAMES = {
    "float32": "float32",
    "float": "float32",
    "float16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
}


# KV cache element types a cache may hold instead of the model's: vLLM's names. Plain "fp8" is e4m3,
# the format with more mantissa; values are stored unscaled (scale 1.0) and saturate at the format's
# largest finite value, as vLLM stores them when a checkpoint brings no KV scales.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
_KV_CACHE_TORCH_NAMES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


# Weight quantization methods, vLLM's names. The online ones are applied at load to a 16/32-bit checkpoint:
# "fp8" holds every decoder linear in float8 e4m3 with one scale per output row and quantizes each activation row
# on the fly; "int8" does the same in int8 (W8A8); "int4" keeps 4-bit weights only (Q4_0 blocks on the CPU, groups of
# 128 on CUDA: layers/quantization/int4.py) and multiplies in the activations' dtype. The others name the layout a quantized checkpoint stores
# (layers/quantization/), which its own quantization_config selects; passing one must match it. "gguf" is what a
# GGUF file gets on the CPU: its matrices stay in their ggml blocks (EngineArgs.gguf_dequantize turns that off).
ONLINE_QUANTIZATION_METHODS = ("fp8", "int8", "int4")
QUANTIZATION_METHODS = ONLINE_QUANTIZATION_METHODS + ("awq", "gptq", "compressed-tensors", "modelopt", "gguf")
# vLLM's names for its kernels over stored AWQ/GPTQ layouts, which scripts pass as --quantization: each reads the
# checkpoints whose quant_method it lists, with the kernels pagedllm picks for them.
QUANTIZATION_KERNEL_ALIASES = {"awq_marlin": ("awq",), "gptq_marlin": ("gptq",), "moe_wna16": ("awq", "gptq")}


def resolve_kv_cache_dtype(cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's element type: ``auto`` is the model's dtype, the fp8 names their torch float8 types."""
    import torch

    if cache_dtype == "auto":
        return model_dtype
    if cache_dtype not in _KV_CACHE_TORCH_NAMES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {cache_dtype!r}")
    return getattr(torch, _KV_CACHE_TORCH_NAMES[cache_dtype])


def resolve_dtype(dtype: str | torch.dtype, hf_config: Any, device_type: str) -> torch.dtype:
    """``auto`` keeps the checkpoint's dtype on GPUs; on CPUs half types are slow, so it means float32."""
    import torch

    _DTYPES = {k: getattr(torch, v) for k, v in _DTYPE_NAMES.items()}
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {dtype!r}")
        return _DTYPES[dtype]
    if device_type == "cpu":
        return torch.float32
    cfg_dtype = getattr(hf_config, "torch_dtype", None) or getattr(hf_config, "dtype", None)
    if isinstance(cfg_dtype, str):
        cfg_dtype = _DTYPES.get(cfg_dtype)
    if cfg_dtype in (None, torch.float32):
        return torch.bfloat16
    return cfg_dtype


@dataclass(frozen=True)
class ModelConfig:
    model: str  # local directory or file the weights come from (after any hub download)
    tokenizer: str | None
    hf_config: Any  # transformers.PretrainedConfig of the text model
    dtype: torch.dtype
    max_model_len: int
    seed: int = 0
    trust_remote_code: bool = False
    skip_tokenizer_init: bool = False
    generation_config: dict = field(default_factory=dict)  # defaults from generation_config.json
    gguf_file: str | None = None
    quantization: str | None = None  # a QUANTIZATION_METHODS name applied to the linears at load, or None
    cpu_int8_activations: bool = False  # GGUF / int4 CPU products quantize decode activations to 8-bit groups

    @property
    def architecture(self) -> str:
        archs = getattr(self.hf_config, "architectures", None) or []
        return archs[0] if archs else ""

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)

    @property
    def num_layers(self) -> int:
        return int(self.hf_config.num_hidden_layers)

    @property
    def num_heads(self) -> int:
        return int(self.hf_config.num_attention_heads)

    @property
    def num_kv_heads(self) -> int:
        return int(getattr(self.hf_config, "num_key_value_heads", None) or self.num_heads)

    @property
    def head_size(self) -> int:
        head_dim = getattr(self.hf_config, "head_dim", None)
        return int(head_dim or self.hf_config.hidden_size // self.num_heads)

    def kv_bytes_per_token(self, cache_dtype: torch.dtype | None = None, num_layers: int | None = None,
                           num_kv_heads: int | None = None) -> int:
        """Bytes of K and V for one token, in ``cache_dtype`` (default: the model's dtype), across all layers
        and KV heads unless a rank's share (``num_layers``, ``num_kv_heads``) is given."""
        elem = (cache_dtype or self.dtype).itemsize
        layers = self.num_layers if num_layers is None else num_layers
        kv_heads = self.num_kv_heads if num_kv_heads is None else num_kv_heads
        return 2 * layers * kv_heads * self.head_size * elem

    def num_kv_heads_per_rank(self, tensor_parallel_size: int) -> int:
        """KV heads each tensor-parallel rank holds: a share, or one replicated head when there are fewer."""
        return max(1, self.num_kv_heads // tensor_parallel_size)


DISTRIBUTED_EXECUTOR_BACKENDS = ("uni", "mp", "ray")


# Each data-parallel core is a process holding a whole model copy; more than this is a typo, not a plan.
MAX_DATA_PARALLEL_SIZE = 64


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # "uni": one worker in the engine's process; "mp": one spawned process per rank on this host;
    # "ray": one Ray actor per rank, on the nodes of a Ray cluster. None: "uni" for one rank, "mp" for more.
    distributed_executor_backend: str | None = None
    # A MoE layer's experts split whole between a stage's tensor-parallel ranks (tokens sent to them by
    # all-to-all) instead of each expert's rows split between them.
    enable_expert_parallel: bool = False
    # Engine cores (each with its own tensor/pipeline-parallel group, requests and KV cache) behind one
    # front-end. Independent, unless enable_expert_parallel: then their ranks form one expert-parallel group
    # per MoE layer (dp x tp ranks) and the cores step in lockstep (engine/core_proc.py), synchronously: one
    # model call per step, no asynchronous scheduling (EngineArgs refuses it), no CUDA graphs.
    data_parallel_size: int = 1
    # Data parallelism with expert parallelism, as one core sees it (the front-end fills these; plain data):
    # its index among the cores, the tcp:// address where every core's model ranks meet as one world, and
    # the tcp:// address of the cores' own lockstep group.
    data_parallel_rank: int = 0
    data_parallel_init_method: str | None = None
    data_parallel_sync_method: str | None = None

    @property
    def world_size(self) -> int:
        """One engine core's ranks (tensor x pipeline)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def dp_expert_parallel(self) -> bool:
        """Whether the data-parallel cores share their MoE layers' experts (and so must step in lockstep)."""
        return self.enable_expert_parallel and self.data_parallel_size > 1

    @property
    def expert_parallel_size(self) -> int:
        """Ranks that split a MoE layer's experts: the core's tensor ranks, times the cores under data parallelism."""
        if not self.enable_expert_parallel:
            return 1
        return self.tensor_parallel_size * (self.data_parallel_size if self.dp_expert_parallel else 1)

    @property
    def executor_backend(self) -> str:
        if self.distributed_executor_backend is not None:
            return self.distributed_executor_backend
        return "uni" if self.world_size == 1 else "mp"

    def check(self) -> None:
        """Sizes and backend alone, before any model is read."""
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        backend = self.distributed_executor_backend
        if backend is not None and backend not in DISTRIBUTED_EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend must be one of {', '.join(DISTRIBUTED_EXECUTOR_BACKENDS)} "
                             f"or None; got {backend!r}")
        if self.data_parallel_size > MAX_DATA_PARALLEL_SIZE:
            raise ValueError(f"data_parallel_size must be <= {MAX_DATA_PARALLEL_SIZE} (one engine-core process each), "
                             f"got {self.data_parallel_size}")
        if self.dp_expert_parallel:
            # Pipeline stages keep several batches in flight, which the cores' one-model-call-per-step
            # lockstep does not yet account for; Ray ranks may sit on other nodes than the loopback world.
            if self.pipeline_parallel_size > 1:
                raise NotImplementedError(
                    f"pipeline_parallel_size {self.pipeline_parallel_size} with data_parallel_size "
                    f"{self.data_parallel_size} and enable_expert_parallel is not implemented yet; use "
                    "pipeline_parallel_size 1 (tensor parallelism inside each core works)")
            if backend == "ray":
                raise NotImplementedError(
                    f"distributed_executor_backend 'ray' with data_parallel_size {self.data_parallel_size} and "
                    "enable_expert_parallel is not implemented yet; use 'mp' (one host)")
        if not 0 <= self.data_parallel_rank < self.data_parallel_size:
            raise ValueError(f"data_parallel_rank {self.data_parallel_rank} is outside data_parallel_size "
                             f"{self.data_parallel_size}")
        if backend == "uni" and self.world_size > 1:
            raise ValueError(f"distributed_executor_backend='uni' runs one worker, but tensor_parallel_size "
                             f"{self.tensor_parallel_size} x pipeline_parallel_size {self.pipeline_parallel_size} "
                             f"= {self.world_size} ranks; use 'mp'")

    def check_model(self, model_config: ModelConfig) -> None:
        """What the model's shapes allow, named with their numbers (called before any weight is loaded)."""
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        heads, kv_heads, layers = model_config.num_heads, model_config.num_kv_heads, model_config.num_layers
        if heads % tp:
            raise ValueError(f"the model's {heads} attention heads are not divisible by tensor_parallel_size {tp}")
        if kv_heads >= tp and kv_heads % tp:
            raise ValueError(f"the model's {kv_heads} KV heads are not divisible by tensor_parallel_size {tp}")
        if kv_heads < tp and tp % kv_heads:
            raise ValueError(f"tensor_parallel_size {tp} is not a multiple of the model's {kv_heads} KV heads "
                             "(each KV head must be replicated on a whole number of ranks)")
        cfg = model_config.hf_config
        for name in ("intermediate_size", "hidden_size"):
            size = getattr(cfg, name, None)
            if isinstance(size, int) and size % tp:
                raise ValueError(f"the model's {name} {size} is not divisible by tensor_parallel_size {tp}")
        if layers < pp:
            raise ValueError(f"the model's {layers} layers are fewer than pipeline_parallel_size {pp}")
        experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
        if isinstance(experts, int) and experts > 0 and self.dp_expert_parallel:
            dp, ep = self.data_parallel_size, self.expert_parallel_size
            if experts % ep:
                raise ValueError(f"the model's {experts} experts are not divisible by data_parallel_size {dp} x "
                                 f"tensor_parallel_size {tp} = {ep} expert-parallel ranks (enable_expert_parallel "
                                 "gives each rank whole experts)")
        elif self.dp_expert_parallel:
            raise ValueError(f"enable_expert_parallel with data_parallel_size {self.data_parallel_size} splits a "
                             "mixture-of-experts model's experts between the cores, and this model has no experts "
                             "(num_local_experts / num_experts); drop enable_expert_parallel")
        elif isinstance(experts, int) and experts > 0 and tp > 1:
            moe_inter = getattr(cfg, "moe_intermediate_size", None) or getattr(cfg, "intermediate_size", None)
            if self.enable_expert_parallel and experts % tp:
                raise ValueError(f"the model's {experts} experts are not divisible by tensor_parallel_size {tp} "
                                 "(enable_expert_parallel gives each rank whole experts)")
            if not self.enable_expert_parallel and isinstance(moe_inter, int) and moe_inter % tp:
                raise ValueError(f"the model's moe_intermediate_size {moe_inter} is not divisible by "
                                 f"tensor_parallel_size {tp}")


@dataclass(frozen=True)
class StructuredOutputsConfig:
    # A reasoning model's `<think>` text stays unconstrained: a request's grammar applies from the end of
    # its reasoning on (structured_output/reasoning.py). None: grammars apply from the first token.
    reasoning_parser: str | None = None


@dataclass(frozen=True)
class DeviceConfig:
    device: str = "cpu"  # "cpu" or "cuda" (resolved from "auto")

    @property
    def torch_device(self) -> torch.device:
        import torch

        return torch.device(self.device)


@dataclass(frozen=True)
class LoadConfig:
    load_format: str = "auto"  # auto | safetensors | pt | dummy | gguf
    download_dir: str | None = None


@dataclass(frozen=True)
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    device_config: DeviceConfig
    load_config: LoadConfig
    attention_backend: str | None = None
    enforce_eager: bool = False
    graph_config: GraphConfig = GraphConfig()  # which CUDA graphs, from vLLM's compilation_config
    structured_outputs_config: StructuredOutputsConfig = StructuredOutputsConfig()

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        """The element type the KV cache is allocated in."""
        return resolve_kv_cache_dtype(self.cache_config.cache_dtype, self.model_config.dtype)
