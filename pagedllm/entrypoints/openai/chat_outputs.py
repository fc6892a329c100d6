"""One chat choice's generated text as OpenAI's message: reasoning (`--reasoning-parser`) split off first,
then tool calls read from the rest; whole, or as stream deltas."""
from __future__ import annotations

from pagedllm.entrypoints.openai.protocol import (
    ChatResponseMessage,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCallOut,
    ToolCallOut,
)
from pagedllm.entrypoints.openai.reasoning_parsers import ReasoningParser
from pagedllm.entrypoints.openai.tool_calling import ToolPlan
from pagedllm.entrypoints.openai.tool_parsers import CallDelta


def _merged(deltas: list[CallDelta]) -> list[CallDelta]:
    """One entry per call in a chunk, as OpenAI sends them: a call's name and its first argument text
    arriving together go out together."""
    out: list[CallDelta] = []
    for d in deltas:
        if out and out[-1].index == d.index and d.id is None:
            out[-1] = CallDelta(out[-1].index, out[-1].id, out[-1].name, out[-1].arguments + d.arguments)
        else:
            out.append(d)
    return out


def _delta_call(d: CallDelta) -> DeltaToolCall:
    if d.id is not None:
        return DeltaToolCall(index=d.index, id=d.id, type="function",
                             function=DeltaFunctionCall(name=d.name, arguments=d.arguments))
    return DeltaToolCall(index=d.index, function=DeltaFunctionCall(arguments=d.arguments))


class ChoiceReader:
    def __init__(self, plan: ToolPlan, reasoning: ReasoningParser | None) -> None:
        self.plan = plan
        self.reasoning = reasoning
        self.reasoning_stream = reasoning.stream() if reasoning is not None else None
        self.tool_stream = plan.parser.stream() if plan.parser is not None else None
        self.called = False

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """OpenAI's "tool_calls" for an output that ended by itself in tool calls."""
        return "tool_calls" if self.called and engine_reason == "stop" else engine_reason

    def message(self, text: str) -> ChatResponseMessage:
        reasoning, content = None, text
        if self.reasoning is not None:
            split = self.reasoning.split(text)
            reasoning, content = split.reasoning, split.content
        calls = []
        if self.plan.parser is not None:
            extracted = self.plan.parser.extract(content or "")
            if extracted.calls:
                content, calls = extracted.content, extracted.calls
        if not self.plan.parallel:
            calls = calls[:1]
        self.called = bool(calls)
        tool_calls = [ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments)) for c in calls]
        return ChatResponseMessage(content=content, reasoning_content=reasoning, tool_calls=tool_calls or None)

    def delta(self, text: str, final: bool) -> DeltaMessage:
        """What `text`, the output's next piece, adds (`final`: the output ends with it)."""
        reasoning, content = "", text
        if self.reasoning_stream is not None:
            reasoning, content = self.reasoning_stream.feed(text)
            if final:
                r, c = self.reasoning_stream.finish()
                reasoning, content = reasoning + r, content + c
        calls: list[CallDelta] = []
        if self.tool_stream is not None:
            content, calls = self.tool_stream.feed(content) if content else ("", [])
            if final:
                c, more = self.tool_stream.finish()
                content, calls = content + c, calls + more
            if not self.plan.parallel:
                calls = [d for d in calls if d.index == 0]
            self.called = self.called or bool(calls)
        if self.reasoning_stream is None and self.tool_stream is None:
            return DeltaMessage(content=text)
        return DeltaMessage(
            content=content or None,
            reasoning_content=reasoning or None,
            tool_calls=[_delta_call(d) for d in _merged(calls)] or None,
        )
