"""pagedllm: a fast, exact LLM inference and serving engine with a vLLM-compatible API."""
from pagedllm.engine_args import EngineArgs
from pagedllm.entrypoints.llm import LLM
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams
from pagedllm.version import __version__

__all__ = ["LLM", "EngineArgs", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "Logprob", "__version__"]
