"""Triton kernels of mixture-of-experts layers: expert alignment, the grouped GEMMs and their driver."""
from pagedllm.kernels.moe.fused_moe import fused_experts, usable

__all__ = ["fused_experts", "usable"]
