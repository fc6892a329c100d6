"""The OpenAI-compatible server (pagedllm serve); server packages are imported by its modules only."""
