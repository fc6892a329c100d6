"""Structured outputs: constraints (JSON schema, regex, choice, grammar) enforced by a token bitmask; the
request-side parameters are ``pagedllm.sampling_params.StructuredOutputsParams``."""
