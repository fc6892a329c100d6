"""What a chat request's `tools` and `tool_choice` ask for: the tools handed to the chat template, and how
the output becomes tool calls. `required` and a named function are forced by a JSON schema built from the
tools' parameter schemas (structured outputs); `auto` is read from free text by the server's
--tool-call-parser, and only when the server runs with --enable-auto-tool-choice (as vLLM)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pagedllm.entrypoints.openai.errors import bad_request
from pagedllm.entrypoints.openai.structured_request import Constraint
from pagedllm.entrypoints.openai.tool_parsers import (
    CallDelta,
    Extracted,
    FunctionCall,
    ToolParser,
    ToolStream,
    tool_call_id,
)
from pagedllm.entrypoints.openai.tool_parsers.json_calls import JsonCallsParser
from pagedllm.sampling_params import StructuredOutputsParams

_EMPTY_OBJECT = {"type": "object", "properties": {}}


@dataclass
class ToolPlan:
    mode: str  # "none", "auto", "required" or "named"
    tools: list[dict[str, Any]] | None  # for the chat template
    parser: ToolParser | None = None  # reads calls out of the output
    constraint: Constraint | None = None
    parallel: bool = True


def _parameters(tool: Any) -> dict[str, Any]:
    params = tool.function.parameters
    return params if params else dict(_EMPTY_OBJECT)


def _lift_defs(schemas: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Each schema without its `$defs`, and all of them at the root: a `#/$defs/X` reference (pydantic's
    kind) resolves against the root of the combined schema."""
    defs: dict[str, Any] = {}
    out = []
    for s in schemas:
        s = dict(s)
        for name, d in (s.pop("$defs", None) or {}).items():
            if name in defs and defs[name] != d:
                raise bad_request(f"tools define $defs {name!r} twice, differently; rename one of them", param="tools")
            defs[name] = d
        out.append(s)
    return out, defs


def required_schema(tools: list[Any], parallel: bool) -> dict[str, Any]:
    """An array of one or more {name, parameters} objects, each naming one of the tools."""
    params, defs = _lift_defs([_parameters(t) for t in tools])
    items = [
        {
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [t.function.name]}, "parameters": p},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t, p in zip(tools, params)
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


class _RequiredCallsParser(JsonCallsParser):
    """The output `tool_choice: "required"` forces: `[{"name": ..., "parameters": {...}}, ...]`."""

    name = "required"
    markers = ("[",)
    separators = ("[", "]")
    at_start_only = True
    args_keys = ("parameters",)


class _NamedStream(ToolStream):
    def __init__(self, function: str) -> None:
        self.function = function
        self.started = False

    @property
    def num_calls(self) -> int:
        return int(self.started)

    def feed(self, delta: str) -> tuple[str, list[CallDelta]]:
        deltas = []
        if not self.started:
            self.started = True
            deltas.append(CallDelta(index=0, id=tool_call_id(), name=self.function))
        if delta:
            deltas.append(CallDelta(index=0, arguments=delta))
        return "", deltas

    def finish(self) -> tuple[str, list[CallDelta]]:
        return self.feed("")


class _NamedParser(ToolParser):
    """The output of a named tool_choice: the named function's arguments, and nothing else."""

    name = "named"

    def __init__(self, function: str) -> None:
        self.function = function

    def extract(self, text: str) -> Extracted:
        try:
            arguments = json.dumps(json.loads(text), ensure_ascii=False)
        except ValueError:
            arguments = text  # cut short (max_tokens): sent as generated, as a stream would have
        return Extracted(content=None, calls=[FunctionCall(name=self.function, arguments=arguments)])

    def stream(self) -> ToolStream:
        return _NamedStream(self.function)


def _shown(choice: Any) -> str:
    return json.dumps(choice.model_dump() if hasattr(choice, "model_dump") else choice)


def plan_tools(req: Any, auto_parser: ToolParser | None) -> ToolPlan:
    tools = req.tools or None
    choice = req.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if tools is None:
        # An empty tool list leaves nothing to require (vLLM answers it as "none", as OpenAI does).
        if choice in ("none", "auto") or (choice == "required" and req.tools == []):
            return ToolPlan("none", None)
        raise bad_request(f"tool_choice {_shown(choice)} needs tools, and the request has none", param="tool_choice")
    names = [t.function.name for t in tools]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise bad_request(f"tools name the function {repeated[0]!r} more than once", param="tools")
    template_tools = [t.model_dump(by_alias=True, exclude_none=True) for t in tools]
    parallel = req.parallel_tool_calls is not False
    if choice == "none":
        return ToolPlan("none", template_tools)
    if choice == "auto":
        if auto_parser is None:
            given = req.tool_choice is not None
            raise bad_request(
                ('tool_choice "auto"' if given else 'tools without tool_choice (which then defaults to "auto")')
                + " requires --enable-auto-tool-choice and --tool-call-parser to be set on the server; send "
                'tool_choice "required", a named function, or "none"',
                param="tool_choice" if given else "tools",
            )
        return ToolPlan("auto", template_tools, parser=auto_parser, parallel=parallel)
    if choice == "required":
        schema = required_schema(tools, parallel)
        constraint = Constraint(StructuredOutputsParams(json=schema), "tools")
        return ToolPlan("required", template_tools, _RequiredCallsParser(), constraint, parallel)
    name = choice.function.name
    if name not in names:
        raise bad_request(
            f"tool_choice names the function {name!r}, which is not among the tools ({', '.join(names)})",
            param="tool_choice",
        )
    schema = _parameters(tools[names.index(name)])
    constraint = Constraint(StructuredOutputsParams(json=schema), "tools")
    return ToolPlan("named", template_tools, _NamedParser(name), constraint, parallel=False)
