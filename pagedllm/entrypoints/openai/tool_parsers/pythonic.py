"""Tool calls written as Python calls, `[get_weather(city="Paris"), get_time()]`, optionally fenced as
```tool_code```: the format Google documents for Gemma 3 function calling (Gemma 3 has no tool tokens;
its prompt asks for Python calls) and that Llama 3.2 and others produce under a pythonic template.
Arguments must be keywords with literal values; anything else is content."""
from __future__ import annotations

import ast
import re
from typing import Any

from pagedllm.entrypoints.openai.tool_parsers.base import (
    CallDelta,
    Extracted,
    FunctionCall,
    ToolParser,
    ToolStream,
    arguments_text,
    tool_call_id,
)

_FENCES = ("```tool_code", "```python")
_NAMES = {"true": True, "false": False, "null": None, "none": None}
_QUOTE = re.compile(r"""(['"])(?:[^'"\\]|\\.|(?!\1)['"])*\1""", re.DOTALL)


def _literal(node: ast.AST) -> Any:
    if isinstance(node, ast.Name) and node.id.lower() in _NAMES:  # JSON's spellings, as models write them
        return _NAMES[node.id.lower()]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise ValueError("** in a dict")
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values)}
    return ast.literal_eval(node)


def _call(node: ast.AST) -> FunctionCall:
    if not isinstance(node, ast.Call) or node.args:
        raise ValueError("not a call with keyword arguments only")
    name = ast.unparse(node.func)
    if not re.fullmatch(r"[A-Za-z_][\w.\-]*", name):
        raise ValueError(f"not a function name: {name!r}")
    if any(k.arg is None for k in node.keywords):
        raise ValueError("** in a call")
    return FunctionCall(name=name, arguments=arguments_text({k.arg: _literal(k.value) for k in node.keywords}))


def _unfence(text: str) -> str | None:
    """The calls' source: the text itself, or what a ```tool_code fence holds; None if neither."""
    body = text.strip()
    for fence in _FENCES:
        if body.startswith(fence):
            body = body[len(fence):]
            body = body[:body.rindex("```")] if "```" in body else body
            return body.strip()
    return body if body.startswith("[") or re.match(r"[A-Za-z_][\w.]*\(", body) else None


def parse_calls(source: str) -> list[FunctionCall]:
    tree = ast.parse(source.strip(), mode="eval").body
    nodes = tree.elts if isinstance(tree, ast.List) else [tree]
    if not nodes:
        raise ValueError("an empty list")
    return [_call(n) for n in nodes]


def _complete_calls(source: str) -> list[str]:
    """The source text of each call finished so far in `[call(...), call(...` (or a bare call)."""
    out = []
    depth = 0
    start = None
    i = 0
    base = 1 if source.lstrip().startswith("[") else 0
    while i < len(source):
        ch = source[i]
        if ch in "'\"":
            m = _QUOTE.match(source, i)
            if m is None:
                break
            i = m.end()
            continue
        if ch in "([{":
            depth += 1
            if depth == base + 1 and ch == "(" and start is None:
                start = len(source[:i]) - len(re.search(r"[\w.]*$", source[:i]).group(0))
        elif ch in ")]}":
            depth -= 1
            if depth == base and start is not None:
                out.append(source[start:i + 1])
                start = None
        i += 1
    return out


class _PythonicStream(ToolStream):
    def __init__(self) -> None:
        self.text = ""
        self.mode: str | None = None  # "content" or "calls", once known
        self.sent = 0
        self.calls: list[FunctionCall] = []
        self.failed = False

    @property
    def num_calls(self) -> int:
        return len(self.calls)

    def feed(self, delta: str) -> tuple[str, list[CallDelta]]:
        self.text += delta
        return self._step(final=False)

    def finish(self) -> tuple[str, list[CallDelta]]:
        return self._step(final=True)

    def _step(self, final: bool) -> tuple[str, list[CallDelta]]:
        if self.mode is None:
            head = self.text.lstrip()
            if head.startswith("[") or any(head.startswith(f) for f in _FENCES):
                self.mode = "calls"
            elif final or (head and not any(f.startswith(head) for f in _FENCES)):
                self.mode = "content"
        if self.mode == "content":
            out, self.sent = self.text[self.sent:], len(self.text)
            return out, []
        if self.mode is None:
            return "", []
        deltas: list[CallDelta] = []
        source = _unfence(self.text) or ""
        if not self.failed:
            for piece in _complete_calls(source)[len(self.calls):]:
                try:
                    call = _call(ast.parse(piece, mode="eval").body)
                except (SyntaxError, ValueError):
                    self.failed = True
                    break
                call.id = tool_call_id()
                deltas.append(CallDelta(index=len(self.calls), id=call.id, name=call.name, arguments=call.arguments))
                self.calls.append(call)
        if final and not self.calls:
            out, self.sent = self.text[self.sent:], len(self.text)
            return out, deltas
        return "", deltas


class PythonicToolParser(ToolParser):
    name = "pythonic"

    def extract(self, text: str) -> Extracted:
        source = _unfence(text)
        if source is None:
            return Extracted(content=text, calls=[])
        try:
            return Extracted(content=None, calls=parse_calls(source))
        except (SyntaxError, ValueError, TypeError):
            return Extracted(content=text, calls=[])

    def stream(self) -> ToolStream:
        return _PythonicStream()
