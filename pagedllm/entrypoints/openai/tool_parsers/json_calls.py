"""Tool calls written as JSON objects `{"name": ..., "arguments": {...}}` after a marker: Hermes/Qwen
(`<tool_call>...</tool_call>`), Llama 3 (a whole output of `{"name", "parameters"}` objects, after
`<|python_tag|>` or not) and Mistral (`[TOOL_CALLS][...]`). One scanner serves whole outputs and streams,
so both read an output the same way."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import ClassVar

from pagedllm.entrypoints.openai.tool_parsers.base import (
    CallDelta,
    Extracted,
    FunctionCall,
    ToolParser,
    ToolStream,
    arguments_text,
    held_prefix,
    tool_call_id,
)
from pagedllm.entrypoints.openai.tool_parsers.json_scan import NotJSON, scan_object, skip_ws, value_end

_NAME = re.compile(r"[A-Za-z_][\w.\-]*")


@dataclass
class _Call:
    start: int
    name: str | None = None
    args: tuple[int, int | None] | None = None  # the arguments value's span in the text
    end: int | None = None


class _Scanner:
    def __init__(self, parser: JsonCallsParser) -> None:
        self.p = parser
        self.text = ""
        self.content_end = 0
        self.region: int | None = None  # where calls may start, once the output turned out to hold some
        self.plain = False  # the output cannot hold calls (at_start_only formats)
        self.calls: list[_Call] = []
        self.pos = 0  # where the next call or separator is read
        self.invalid = False
        self.done = False  # text that is no call followed the calls

    def scan(self, final: bool) -> None:
        if self.region is None and not self.plain:
            self._find_region(final)
        if self.region is not None and not (self.invalid or self.done):
            try:
                self._scan_calls(final)
            except (NotJSON, ValueError):
                self.invalid = True

    def _find_region(self, final: bool) -> None:
        text, p = self.text, self.p
        if p.at_start_only:
            s = skip_ws(text, 0)
            rest = text[s:]
            if rest.startswith("{"):
                self.region = self.pos = s
            elif any(rest.startswith(m) for m in p.markers):
                m = next(m for m in p.markers if rest.startswith(m))
                self.region = self.pos = s + len(m)
            elif final or (rest and not any(m.startswith(rest) for m in p.markers)):
                self.plain = True
                self.content_end = len(text)
            return
        found = [(text.find(m), m) for m in p.markers if m in text]
        if found:
            at, m = min(found)
            self.content_end = at
            self.region = self.pos = at + len(m)
        else:
            self.content_end = len(text) - (0 if final else held_prefix(text, p.markers))

    def _scan_calls(self, final: bool) -> None:
        text, n = self.text, len(self.text)
        while True:
            j = skip_ws(text, self.pos)
            while j < n and (text[j] in ",;" or any(text.startswith(s, j) for s in self.p.separators)):
                if not final and any(len(s) > n - j and s.startswith(text[j:]) for s in self.p.separators):
                    self.pos = j
                    return  # a longer separator ("[TOOL_CALLS]" after "[") may still be being written
                sep = next((s for s in self.p.separators if text.startswith(s, j)), text[j])
                j = skip_ws(text, j + len(sep))
            self.pos = j
            if j >= n:
                return
            if text[j] != "{":
                if not final and any(s.startswith(text[j:]) for s in self.p.separators):
                    return  # a separator still being written
                if self.p.args_marker is not None:
                    if not self._scan_named_call(j, final):
                        return
                    continue
                self.done = True
                return
            if not self.calls or self.calls[-1].end is not None:
                self.calls.append(_Call(start=j))
            call = self.calls[-1]
            obj = scan_object(text, j, final)
            name = obj.members.get("name")
            if name is not None and name[1] is not None and call.name is None:
                value = json.loads(text[name[0]:name[1]])
                if not isinstance(value, str):
                    raise NotJSON("a tool call's name must be a string")
                call.name = value
            key = next((k for k in self.p.args_keys if k in obj.members), None)
            call.args = obj.members[key] if key else None
            if obj.end is None:
                return
            call.end = self.pos = obj.end
            if call.name is None:
                raise NotJSON("a tool call without a name")


    def _scan_named_call(self, j: int, final: bool) -> bool:
        """`name[ARGS]{...}` (Mistral's newer format) at j; False while incomplete or once no call is there."""
        text, marker = self.text, self.p.args_marker
        m = _NAME.match(text, j)
        if m is None:
            self.done = True
            return False
        rest = text[m.end():]
        if not rest.startswith(marker):
            if final or not marker.startswith(rest):
                self.done = True
            return False
        if not self.calls or self.calls[-1].end is not None:
            self.calls.append(_Call(start=j))
        call = self.calls[-1]
        call.name = m.group(0)
        a0 = skip_ws(text, m.end() + len(marker))
        if a0 >= len(text):
            return False
        a1 = value_end(text, a0, final)
        call.args = (a0, a1)
        if a1 is None:
            return False
        call.end = self.pos = a1
        return True


class _JsonStream(ToolStream):
    def __init__(self, parser: JsonCallsParser) -> None:
        self.s = _Scanner(parser)
        self.content_sent = 0
        self.ids: list[str] = []
        self.args_sent: list[int] = []

    @property
    def num_calls(self) -> int:
        return len(self.ids)

    def feed(self, delta: str) -> tuple[str, list[CallDelta]]:
        self.s.text += delta
        self.s.scan(final=False)
        return self._emit(final=False)

    def finish(self) -> tuple[str, list[CallDelta]]:
        self.s.scan(final=True)
        return self._emit(final=True)

    def _emit(self, final: bool) -> tuple[str, list[CallDelta]]:
        s = self.s
        end = len(s.text) if s.plain or (final and not self.ids) else s.content_end
        content = s.text[self.content_sent:end] if end > self.content_sent else ""
        self.content_sent = max(self.content_sent, end)
        deltas: list[CallDelta] = []
        if s.invalid and not self.ids:
            return content, deltas
        for i, call in enumerate(s.calls):
            if call.name is None:
                break
            if i == len(self.ids):
                self.ids.append(tool_call_id())
                self.args_sent.append(0)
                deltas.append(CallDelta(index=i, id=self.ids[i], name=call.name))
            if call.args is not None:
                a0, a1 = call.args
                raw = s.text[a0:a1 if a1 is not None else len(s.text)]
                if len(raw) > self.args_sent[i]:
                    deltas.append(CallDelta(index=i, arguments=raw[self.args_sent[i]:]))
                    self.args_sent[i] = len(raw)
            elif call.end is not None and self.args_sent[i] == 0:
                deltas.append(CallDelta(index=i, arguments="{}"))
                self.args_sent[i] = 2
        return content, deltas


class JsonCallsParser(ToolParser):
    markers: ClassVar[tuple[str, ...]]
    # Literal text allowed between calls (besides whitespace, ',' and ';').
    separators: ClassVar[tuple[str, ...]] = ()
    # Calls only when the output starts with them (with a marker or at once with '{').
    at_start_only: ClassVar[bool] = False
    args_keys: ClassVar[tuple[str, ...]] = ("arguments", "parameters")
    # Between a bare function name and its JSON arguments, in formats that write calls that way.
    args_marker: ClassVar[str | None] = None

    def extract(self, text: str) -> Extracted:
        s = _Scanner(self)
        s.text = text
        s.scan(final=True)
        # A call cut short after its arguments (max_tokens) is kept, as a stream would have sent it whole.
        calls = [c for c in s.calls if c.name is not None and (c.end is not None or (c.args and c.args[1]))]
        if s.region is None or s.invalid or not calls:
            return Extracted(content=text, calls=[])
        out = []
        for c in calls:
            try:
                args = json.loads(text[c.args[0]:c.args[1]]) if c.args is not None else {}
            except ValueError:
                return Extracted(content=text, calls=[])
            out.append(FunctionCall(name=c.name or "", arguments=arguments_text(args)))
        content = text[:s.content_end].strip()
        return Extracted(content=content or None, calls=out)

    def stream(self) -> ToolStream:
        return _JsonStream(self)


class HermesToolParser(JsonCallsParser):
    """Qwen2.5/Qwen3 and Hermes models: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`."""

    name = "hermes"
    markers = ("<tool_call>",)
    separators = ("<tool_call>", "</tool_call>")


class Llama3JsonToolParser(JsonCallsParser):
    """Llama 3.1-3.3 JSON tool calls: the whole output is `{"name": ..., "parameters": {...}}` objects
    separated by ';', optionally after `<|python_tag|>`."""

    name = "llama3_json"
    markers = ("<|python_tag|>",)
    separators = ("<|python_tag|>",)
    at_start_only = True
    needs_special_tokens = True


class MistralToolParser(JsonCallsParser):
    """Mistral instruct models: `[TOOL_CALLS]` then a JSON array of calls (tokenizers v3-v7), or
    `[TOOL_CALLS]name[ARGS]{...}` for each call (v11 and later)."""

    name = "mistral"
    markers = ("[TOOL_CALLS]",)
    separators = ("[TOOL_CALLS]", "[", "]")
    args_marker = "[ARGS]"
    needs_special_tokens = True
