"""Reasoning parsers, chosen with `--reasoning-parser` (vLLM's names): the text a reasoning model writes
between `<think>` and `</think>` goes to `reasoning_content`, the rest to `content`.

- `qwen3`: Qwen3 opens its output with `<think>` when it thinks (with `enable_thinking: false` its
  template closes an empty block in the prompt), so an output that does not start with `<think>` is all
  content;
- `deepseek_r1`: DeepSeek-R1's template opens the block in the prompt, so the output is reasoning from
  its start (a `<think>` there is dropped) up to `</think>`, and all reasoning if that never comes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pagedllm.entrypoints.openai.tool_parsers.base import held_prefix
from pagedllm.structured_output.reasoning import REASONING_MARKERS

# Both parsers share the delimiters; the engine core's structured outputs read the same table.
START, END = REASONING_MARKERS["qwen3"].start, REASONING_MARKERS["qwen3"].end


@dataclass
class Split:
    reasoning: str | None
    content: str | None


class ReasoningStream:
    """One streamed choice: `feed` each new piece, `finish` once; each returns (reasoning, content)."""

    def __init__(self, starts_in_reasoning: bool) -> None:
        self.text = ""
        self.starts_in_reasoning = starts_in_reasoning
        self.state = "start"  # start -> reasoning -> content
        self.sent = 0
        self.thought = False  # a reasoning block was opened
        self.after_end = False  # the newlines that follow `</think>` are not content

    def feed(self, delta: str) -> tuple[str, str]:
        self.text += delta
        return self._step(final=False)

    def finish(self) -> tuple[str, str]:
        return self._step(final=True)

    @property
    def in_reasoning(self) -> bool:
        return self.state != "content"

    def _step(self, final: bool) -> tuple[str, str]:
        reasoning = ""
        if self.state == "start":
            head = self.text.lstrip()
            if head.startswith(START):
                self.state, self.thought = "reasoning", True
                self.sent = len(self.text) - len(head) + len(START)
            elif not final and START.startswith(head):
                return "", ""  # empty so far, or a `<think>` still being written
            else:
                self.state = "reasoning" if self.starts_in_reasoning else "content"
                self.thought = self.starts_in_reasoning
        if self.state == "reasoning":
            at = self.text.find(END, self.sent)
            if at < 0:
                end = len(self.text) - (0 if final else held_prefix(self.text, (END,)))
                reasoning, self.sent = self.text[self.sent:end], max(self.sent, end)
                return reasoning, ""
            reasoning = self.text[self.sent:at]
            self.state, self.sent, self.after_end = "content", at + len(END), True
        content, self.sent = self.text[self.sent:], len(self.text)
        if self.after_end:
            content = content.lstrip("\n")
            self.after_end = not content
        return reasoning, content


class ReasoningParser:
    name: ClassVar[str]
    starts_in_reasoning: ClassVar[bool]

    def split(self, text: str) -> Split:
        s = self.stream()
        r1, c1 = s.feed(text)
        r2, c2 = s.finish()
        reasoning, content = r1 + r2, c1 + c2
        if s.thought:
            return Split(reasoning=reasoning, content=content or None)
        return Split(reasoning=None, content=content)

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self.starts_in_reasoning)


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    starts_in_reasoning = REASONING_MARKERS[name].starts_in_reasoning


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    starts_in_reasoning = REASONING_MARKERS[name].starts_in_reasoning


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    cls.name: cls for cls in (Qwen3ReasoningParser, DeepSeekR1ReasoningParser)
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    try:
        return REASONING_PARSERS[name]()
    except KeyError:
        raise ValueError(
            f"--reasoning-parser {name!r} is not known; known: {', '.join(sorted(REASONING_PARSERS))}"
        ) from None
