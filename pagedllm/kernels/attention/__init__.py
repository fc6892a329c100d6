"""Paged-attention kernels: the key/value cache write, prompt and decode attention, split-KV reduction."""
