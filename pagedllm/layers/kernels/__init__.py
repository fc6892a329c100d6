"""Fused Triton kernels for the decoder layer's small elementwise ops (RMSNorm, gated activations, rotary), used on CUDA only."""
