"""Structured outputs: constraints (JSON schema, regex, choice, grammar) enforced by a token bitmask."""
from pagedllm.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
