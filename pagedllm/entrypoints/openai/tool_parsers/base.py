"""What every tool-call parser gives the chat handler: the calls in a whole output, and, for a stream,
an object that turns each new piece of text into content and OpenAI tool-call deltas."""
from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class FunctionCall:
    name: str
    arguments: str  # a JSON text, as OpenAI sends it
    id: str = field(default_factory=tool_call_id)


@dataclass
class Extracted:
    content: str | None
    calls: list[FunctionCall]


@dataclass
class CallDelta:
    """A piece of the tool call at `index`: its first delta carries id and name, later ones argument text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


def arguments_text(value: Any) -> str:
    """A call's arguments as the JSON text OpenAI sends; a model that wrote them as a JSON string already
    is taken at its word."""
    if isinstance(value, str):
        try:
            json.loads(value)
            return value
        except ValueError:
            pass
    return json.dumps(value, ensure_ascii=False)


def held_prefix(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of `text` could be the start of a marker, and so wait for more text."""
    longest = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), longest, -1):
            if text.endswith(m[:k]):
                longest = k
                break
    return longest


class ToolStream(ABC):
    """One streamed choice: `feed` each new piece of text, then `finish` once, when the output ends."""

    @abstractmethod
    def feed(self, delta: str) -> tuple[str, list[CallDelta]]:
        """The content to send now, and the tool-call deltas."""

    @abstractmethod
    def finish(self) -> tuple[str, list[CallDelta]]:
        """What was held back, once no more text comes."""

    @property
    @abstractmethod
    def num_calls(self) -> int:
        """Tool calls announced so far."""


class ToolParser(ABC):
    name: ClassVar[str]
    # The parser's markers are special tokens, which the detokenizer would otherwise drop.
    needs_special_tokens: ClassVar[bool] = False

    @abstractmethod
    def extract(self, text: str) -> Extracted:
        """The calls in a whole output; an output that does not parse as calls is all content."""

    @abstractmethod
    def stream(self) -> ToolStream:
        ...
