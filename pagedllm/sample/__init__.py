"""Sampling: batch metadata, the vectorised sampler, and logprob tensors."""
from __future__ import annotations

from pagedllm.sample.logprobs import LogprobsTensors, compute_token_logprobs, gather_logprobs
from pagedllm.sample.metadata import SamplingMetadata, build_sampling_metadata
from pagedllm.sample.sampler import Sampler, SamplerOutput

__all__ = [
    "LogprobsTensors",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "build_sampling_metadata",
    "compute_token_logprobs",
    "gather_logprobs",
]
