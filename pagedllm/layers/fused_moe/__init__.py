"""Mixture-of-experts layers: the router (``select_experts``), the per-expert reference, and ``MoEExperts``."""
from pagedllm.layers.fused_moe.layer import MoEExperts
from pagedllm.layers.fused_moe.reference import fused_experts_ref
from pagedllm.layers.fused_moe.router import select_experts

__all__ = ["MoEExperts", "fused_experts_ref", "select_experts"]
