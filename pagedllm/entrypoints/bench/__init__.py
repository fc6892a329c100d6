"""The `pagedllm bench` subcommands: offline throughput and latency, and load tests of a running server."""
