"""EngineArgs: the flat, vLLM-named engine options (Python and CLI) and their resolution into EngineConfig."""
from __future__ import annotations

import argparse
import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from pagedllm.config import (
    DISTRIBUTED_EXECUTOR_BACKENDS,
    KV_CACHE_DTYPES,
    ONLINE_QUANTIZATION_METHODS,
    QUANTIZATION_KERNEL_ALIASES,
    QUANTIZATION_METHODS,
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    LoadConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    StructuredOutputsConfig,
    resolve_dtype,
)
from pagedllm import vllm_only_args
from pagedllm.graph_config import parse_compilation_config
from pagedllm.structured_output.reasoning import REASONING_MARKERS, reasoning_markers

logger = logging.getLogger("pagedllm")

_DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192


@dataclass
class EngineArgs:
    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_dtype: str = "auto"
    quantization: str | None = None
    # A GGUF file's weights dequantized to dtype at load instead of kept in their blocks (the dense path).
    gguf_dequantize: bool = False
    # CPU products with GGUF / int4 weights quantize their activations to bytes in groups of 32 (llama.cpp's
    # arithmetic): faster decode steps, ~0.5% perplexity instead of float32-exact outputs.
    cpu_int8_activations: bool = False
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    load_format: str = "auto"
    device: str = "auto"
    skip_tokenizer_init: bool = False
    enforce_eager: bool = False
    trust_remote_code: bool = False
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    enable_expert_parallel: bool = False
    data_parallel_size: int = 1
    # Set by the data-parallel front-end for each core it starts under expert parallelism (ParallelConfig);
    # not command-line options.
    data_parallel_rank: int = 0
    data_parallel_init_method: str | None = None
    data_parallel_sync_method: str | None = None
    download_dir: str | None = None
    attention_backend: str | None = None
    num_gpu_blocks_override: int | None = None
    # None: on for CUDA (it hides the engine's CPU work behind the device's), off on CPU (nothing to hide).
    async_scheduling: bool | None = None
    submit_just_in_time: bool = False
    # vLLM's: a dict (or its JSON text, or an int level); only its CUDA-graph keys apply (graph_config.py).
    compilation_config: Any = None
    reasoning_parser: str | None = None

    # ---- CLI -----------------------------------------------------------------------------------
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, model_positional: bool = False) -> argparse.ArgumentParser:
        d = EngineArgs()
        if not model_positional:
            parser.add_argument("--model", type=str, default=None, help="HF model directory, .gguf file or hub id")
        parser.add_argument("--tokenizer", type=str, default=None)
        parser.add_argument("--dtype", type=str, default=d.dtype, choices=["auto", "float32", "float16", "bfloat16", "half", "float"])
        parser.add_argument("--seed", type=int, default=d.seed)
        parser.add_argument("--max-model-len", type=int, default=None)
        parser.add_argument("--block-size", type=int, default=d.block_size, choices=[8, 16, 32, 64])
        parser.add_argument(
            "--kv-cache-dtype", type=str, default=d.kv_cache_dtype, choices=list(KV_CACHE_DTYPES),
            help="element type of the KV cache: auto is the model's dtype; fp8 (= fp8_e4m3) and fp8_e5m2 store "
            "values unscaled in one byte, which holds twice the tokens of a 16-bit cache and halves what decode "
            "attention reads",
        )
        parser.add_argument(
            "--quantization", "-q", type=str, default=None,
            choices=list(QUANTIZATION_METHODS) + list(QUANTIZATION_KERNEL_ALIASES),
            help="quantize the weights at load: fp8 keeps each decoder linear in float8 e4m3 with a scale per "
            "output row and quantizes activations per token (half the weight bytes, float8 tensor-core products); "
            "a GGUF file gets gguf on the CPU (its weights stay in their quantized blocks) without the flag; "
            "awq_marlin, gptq_marlin and moe_wna16 (vLLM's kernel names) read AWQ/GPTQ checkpoints as awq/gptq do",
        )
        parser.add_argument(
            "--gguf-dequantize", action="store_true",
            help="dequantize a GGUF file's weights to --dtype at load and multiply them dense (more memory, slower "
            "on the CPU; the reference path), instead of keeping them in their quantized blocks",
        )
        parser.add_argument(
            "--cpu-int8-activations", action="store_true",
            help="on the CPU, multiply GGUF and --quantization int4 weights by activations quantized to 8-bit groups "
            "of 32 in decode steps (integer dot products, as llama.cpp does): faster decoding, for about +0.5%% "
            "perplexity instead of float32-exact outputs",
        )
        parser.add_argument("--kv-cache-memory-bytes", type=int, default=None)
        parser.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization)
        parser.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
        parser.add_argument("--max-num-batched-tokens", type=int, default=None)
        parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
        parser.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
        parser.add_argument("--load-format", type=str, default=d.load_format, choices=["auto", "safetensors", "pt", "dummy", "gguf"])
        parser.add_argument("--device", type=str, default=d.device, choices=["auto", "cpu", "cuda"])
        parser.add_argument("--skip-tokenizer-init", action="store_true")
        parser.add_argument("--enforce-eager", action="store_true")
        parser.add_argument("--trust-remote-code", action="store_true")
        parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                            help="ranks that split each layer's heads and MLP (one process each)")
        parser.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                            help="stages that each run a contiguous range of the layers (one process per rank)")
        parser.add_argument(
            "--distributed-executor-backend", type=str, default=None, choices=list(DISTRIBUTED_EXECUTOR_BACKENDS),
            help="how workers run: uni (in this process; one rank only), mp (a spawned process per rank on "
            "this host; the default for more than one rank), ray (a Ray actor per rank, across a Ray cluster's nodes)",
        )
        parser.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                            help="engine cores behind one front-end, each with its own TP x PP group; a request "
                            "goes to the least-loaded core or the one holding its prompt's prefix")
        parser.add_argument("--enable-expert-parallel", action="store_true",
                            help="MoE layers: each tensor-parallel rank holds whole experts, tokens sent to them; "
                            "with -dp N the N cores' ranks share the experts (N x tp ranks) and step in lockstep")
        parser.add_argument("--download-dir", type=str, default=None)
        parser.add_argument("--attention-backend", type=str, default=None, choices=["cpu", "torch_ref", "triton"])
        parser.add_argument("--num-gpu-blocks-override", type=int, default=None)
        parser.add_argument(
            "--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
            help="overlap scheduling of the next step with the device's current one (default: on for CUDA)",
        )
        parser.add_argument(
            "--submit-just-in-time", action=argparse.BooleanOptionalAction, default=False,
            help="with asynchronous scheduling, schedule each small decode step just before the device finishes "
            "the previous one, so that new requests join it sooner (lower time to first token under light load; "
            "default: on for `pagedllm serve`, off otherwise)",
        )
        parser.add_argument(
            "--compilation-config", "-O", type=str, default=None,
            help="vLLM's compilation config as JSON (or an integer level, which has no effect): "
            "cudagraph_capture_sizes, max_cudagraph_capture_size and cudagraph_mode choose the CUDA graphs",
        )
        parser.add_argument(
            "--reasoning-parser", type=str, default=None, choices=sorted(REASONING_MARKERS),
            help="the model writes <think>...</think> before its answer: structured outputs constrain the answer "
            "only, and the server splits the reasoning off into reasoning_content",
        )
        vllm_only_args.add_cli_args(parser)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        vllm_only_args.check_cli_args(args)
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})

    # ---- resolution ----------------------------------------------------------------------------
    def _check(self) -> None:
        if self.block_size not in (8, 16, 32, 64):
            raise ValueError(f"block_size must be one of 8, 16, 32, 64; got {self.block_size}")
        if (self.quantization is not None and self.quantization not in QUANTIZATION_METHODS
                and self.quantization not in QUANTIZATION_KERNEL_ALIASES):
            raise ValueError(
                f"quantization must be one of {', '.join(QUANTIZATION_METHODS + tuple(QUANTIZATION_KERNEL_ALIASES))} "
                f"or None; got {self.quantization!r}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {self.kv_cache_dtype!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be > 0, got {self.kv_cache_memory_bytes}")
        if self.reasoning_parser is not None:
            reasoning_markers(self.reasoning_parser)  # raises, naming the known parsers
        self._parallel_config().check()

    def _parallel_config(self) -> ParallelConfig:
        return ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            distributed_executor_backend=self.distributed_executor_backend,
            enable_expert_parallel=self.enable_expert_parallel,
            data_parallel_size=self.data_parallel_size,
            data_parallel_rank=self.data_parallel_rank,
            data_parallel_init_method=self.data_parallel_init_method,
            data_parallel_sync_method=self.data_parallel_sync_method,
        )

    def create_engine_config(self) -> EngineConfig:
        from pagedllm.model_loader.model_source import load_model_source

        self._check()
        graph_config = parse_compilation_config(self.compilation_config)  # its errors before any loading
        device = self._resolve_device()
        gguf_packed = self._gguf_packed(device)
        src = load_model_source(self.model, self.tokenizer, self.load_format, self.download_dir, self.trust_remote_code,
                                gguf_packed=gguf_packed)
        hf_config = src.hf_config
        derived_max_len = _derive_max_model_len(hf_config)
        quantization = self.quantization
        from pagedllm.model_loader.quant_config import checkpoint_quant_config

        qconfig = checkpoint_quant_config(hf_config, warn=False)  # raises, naming it, for what is not supported
        if quantization in QUANTIZATION_KERNEL_ALIASES:
            reads = QUANTIZATION_KERNEL_ALIASES[quantization]
            if qconfig is None or qconfig.name not in reads:
                raise ValueError(f"quantization {quantization!r} reads checkpoints whose quantization_config has "
                                 f"quant_method {' or '.join(map(repr, reads))}; {self.model} has "
                                 f"{'none' if qconfig is None else repr(qconfig.name)}")
            quantization = qconfig.name
        if src.gguf_file is not None:
            if quantization == "gguf" and self.gguf_dequantize:
                raise ValueError("quantization 'gguf' keeps a GGUF file's weights quantized and gguf_dequantize "
                                 "(--gguf-dequantize) dequantizes them: pass one of the two")
            # On a device without the packed kernel "gguf" loads dense, as gguf_dequantize does.
            quantization = "gguf" if gguf_packed and src.load_format == "gguf" else (
                None if quantization == "gguf" else quantization)
        elif quantization == "gguf" or self.gguf_dequantize:
            raise ValueError(f"{'quantization gguf' if quantization == 'gguf' else 'gguf_dequantize'} applies to GGUF "
                             f"files, and {self.model} is not one")
        elif qconfig is not None:
            if quantization not in (None, qconfig.name, qconfig.engine_method):
                raise ValueError(f"quantization {quantization!r} conflicts with the checkpoint's quantization_config "
                                 f"(quant_method {qconfig.name!r})")
            quantization = qconfig.engine_method
        elif quantization is not None and quantization not in ONLINE_QUANTIZATION_METHODS:
            raise ValueError(f"quantization {quantization!r} reads checkpoints stored that way, and {self.model} has no "
                             f"quantization_config; methods applied at load: {', '.join(ONLINE_QUANTIZATION_METHODS)}")
        if self.cpu_int8_activations and not (device == "cpu" and quantization in ("gguf", "int4")):
            raise ValueError(f"cpu_int8_activations (--cpu-int8-activations) applies to GGUF weights kept packed and "
                             f"--quantization int4 on the CPU; here the device is {device} and the weights take "
                             f"quantization {quantization!r}")
        max_model_len = self.max_model_len or derived_max_len
        if max_model_len > derived_max_len:
            raise ValueError(
                f"max_model_len {max_model_len} exceeds the model's maximum context of {derived_max_len} "
                f"(max_position_embeddings in its config)"
            )
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
        max_batched = self.max_num_batched_tokens
        if max_batched is None:
            max_batched = _DEFAULT_MAX_NUM_BATCHED_TOKENS
            if not self.enable_chunked_prefill:
                max_batched = max(max_batched, max_model_len)
        if not self.enable_chunked_prefill and max_batched < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({max_batched}) is smaller than max_model_len ({max_model_len}); "
                "enable chunked prefill or raise max_num_batched_tokens"
            )
        model_config = ModelConfig(
            model=src.model_path,
            tokenizer=src.tokenizer_path,
            hf_config=hf_config,
            dtype=resolve_dtype(self.dtype, hf_config, device),
            max_model_len=max_model_len,
            seed=self.seed,
            trust_remote_code=self.trust_remote_code,
            skip_tokenizer_init=self.skip_tokenizer_init,
            generation_config=src.generation_config,
            gguf_file=src.gguf_file,
            quantization=quantization,
            cpu_int8_activations=self.cpu_int8_activations,
        )
        parallel_config = self._parallel_config()
        parallel_config.check_model(model_config)  # shapes against rank counts, before any weight loads
        if parallel_config.world_size > 1 and device == "cuda" and not self.enforce_eager:
            raise NotImplementedError(
                f"CUDA graphs with tensor_parallel_size {self.tensor_parallel_size} x pipeline_parallel_size "
                f"{self.pipeline_parallel_size} (an all-reduce inside a captured graph) are not implemented yet; "
                "pass enforce_eager=True (--enforce-eager)"
            )
        if parallel_config.dp_expert_parallel and device == "cuda" and not self.enforce_eager:
            raise NotImplementedError(
                f"CUDA graphs with data_parallel_size {self.data_parallel_size} and enable_expert_parallel (the "
                "experts' all-to-alls wait on the host for their sizes) are not implemented yet; pass "
                "enforce_eager=True (--enforce-eager)"
            )
        async_scheduling = device == "cuda" if self.async_scheduling is None else self.async_scheduling
        if parallel_config.dp_expert_parallel:
            # The cores step in lockstep, one model call each per step (engine/core_proc.py): synchronous steps.
            if self.async_scheduling:
                raise NotImplementedError(
                    f"async_scheduling with data_parallel_size {self.data_parallel_size} and enable_expert_parallel "
                    "is not implemented yet (the cores step in lockstep); pass async_scheduling=False "
                    "(--no-async-scheduling)"
                )
            async_scheduling = False
        if parallel_config.world_size > 1:
            if self.async_scheduling:
                raise NotImplementedError(
                    f"async_scheduling with tensor_parallel_size {self.tensor_parallel_size} x "
                    f"pipeline_parallel_size {self.pipeline_parallel_size} is not implemented yet; "
                    "pass async_scheduling=False (--no-async-scheduling)"
                )
            async_scheduling = False
        return EngineConfig(
            model_config=model_config,
            cache_config=CacheConfig(
                block_size=self.block_size,
                enable_prefix_caching=self.enable_prefix_caching,
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                gpu_memory_utilization=self.gpu_memory_utilization,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
                cache_dtype=self.kv_cache_dtype,
            ),
            scheduler_config=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=max_batched,
                max_model_len=max_model_len,
                enable_chunked_prefill=self.enable_chunked_prefill,
                async_scheduling=async_scheduling,
                submit_just_in_time=self.submit_just_in_time,
                # One batch per pipeline stage, so that no stage waits for the others.
                max_concurrent_batches=parallel_config.pipeline_parallel_size,
            ),
            parallel_config=parallel_config,
            device_config=DeviceConfig(device=device),
            load_config=LoadConfig(load_format=src.load_format, download_dir=self.download_dir),
            attention_backend=self.attention_backend,
            enforce_eager=self.enforce_eager,
            graph_config=graph_config,
            structured_outputs_config=StructuredOutputsConfig(reasoning_parser=self.reasoning_parser),
        )

    def _gguf_packed(self, device: str) -> bool:
        """Whether a GGUF file's matrices may stay in their blocks: on a device with the packed kernel, unless
        dequantization is asked for or an online method (fp8, int8) requantizes the dequantized weights."""
        if self.gguf_dequantize or self.quantization in ONLINE_QUANTIZATION_METHODS:
            return False
        from pagedllm.layers.quantization.gguf import packed_kernel_available

        return packed_kernel_available(device)

    def _resolve_device(self) -> str:
        if self.device != "auto":
            if self.device == "cuda":
                import torch

                if not torch.cuda.is_available():
                    raise ValueError("device 'cuda' was asked for, but torch sees no CUDA device")
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"


def _derive_max_model_len(hf_config: Any) -> int:
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        value = getattr(hf_config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return 2048
