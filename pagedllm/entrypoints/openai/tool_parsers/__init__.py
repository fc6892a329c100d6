"""Tool-call parsers for `tool_choice: "auto"`, chosen by name with `--tool-call-parser` (vLLM's names)."""
from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.base import (
    CallDelta,
    Extracted,
    FunctionCall,
    ToolParser,
    ToolStream,
    tool_call_id,
)
from pagedllm.entrypoints.openai.tool_parsers.json_calls import (
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
)
from pagedllm.entrypoints.openai.tool_parsers.pythonic import PythonicToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls for cls in (HermesToolParser, Llama3JsonToolParser, MistralToolParser, PythonicToolParser)
}


def get_tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"--tool-call-parser {name!r} is not known; known: {', '.join(sorted(TOOL_PARSERS))}") from None


__all__ = [
    "TOOL_PARSERS", "CallDelta", "Extracted", "FunctionCall", "ToolParser", "ToolStream", "get_tool_parser",
    "tool_call_id",
]
