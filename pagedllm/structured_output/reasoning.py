"""Where a reasoning model's answer begins: structured outputs constrain the answer, never the `<think>` text.

With a reasoning parser configured (`--reasoning-parser`, vLLM's names), a constrained request's tokens go
to its grammar only once its reasoning has ended. Each request starts in one of three states, read from
its prompt (the last delimiter there wins, so a template that closes an empty block, as Qwen3's does with
`enable_thinking: false`, starts in the answer):

- ``reasoning``: tokens pass unconstrained until the end delimiter's tokens have been generated;
- ``answer``: every token is the grammar's;
- ``start`` (no delimiter in the prompt, for a model that opens its own block, as Qwen3 does): the first
  token may be the grammar's or the start delimiter. The mask allows both, so an answer that begins at
  once is constrained from its first token.

Pure Python, no torch: the engine core keeps one gate per constrained request.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence


@dataclass(frozen=True)
class ReasoningMarkers:
    start: str
    end: str
    starts_in_reasoning: bool  # the template opens the block in the prompt (DeepSeek-R1)


REASONING_MARKERS: dict[str, ReasoningMarkers] = {
    "qwen3": ReasoningMarkers("<think>", "</think>", starts_in_reasoning=False),
    "deepseek_r1": ReasoningMarkers("<think>", "</think>", starts_in_reasoning=True),
}


def reasoning_markers(name: str) -> ReasoningMarkers:
    try:
        return REASONING_MARKERS[name]
    except KeyError:
        raise ValueError(
            f"reasoning_parser {name!r} is not known; known: {', '.join(sorted(REASONING_MARKERS))}"
        ) from None


@dataclass(frozen=True)
class ReasoningTokens:
    """A parser's delimiters as token ids in one tokenizer."""

    start: tuple[int, ...]
    end: tuple[int, ...]
    starts_in_reasoning: bool

    @classmethod
    def from_tokenizer(cls, markers: ReasoningMarkers, tokenizer: Any) -> ReasoningTokens:
        def ids(text: str) -> tuple[int, ...]:
            # Reasoning models hold their delimiters as single added tokens; others spell them in pieces.
            tid = tokenizer.convert_tokens_to_ids(text)
            if isinstance(tid, int) and tid != getattr(tokenizer, "unk_token_id", None):
                return (tid,)
            return tuple(tokenizer.encode(text, add_special_tokens=False))

        return cls(ids(markers.start), ids(markers.end), markers.starts_in_reasoning)

    def gate(self, prompt_token_ids: Sequence[int]) -> ReasoningGate:
        start_at, end_at = _last(prompt_token_ids, self.start), _last(prompt_token_ids, self.end)
        if end_at > start_at:
            state = "answer"
        elif start_at > end_at or self.starts_in_reasoning:
            state = "reasoning"
        else:
            # Without a one-token start delimiter the mask cannot offer it beside the grammar's tokens.
            state = "start" if len(self.start) == 1 else "answer"
        return ReasoningGate(self, state)


def _last(ids: Sequence[int], pattern: tuple[int, ...]) -> int:
    """Index where the last occurrence of ``pattern`` in ``ids`` begins, or -1."""
    n = len(pattern)
    if not n:
        return -1
    for i in range(len(ids) - n, -1, -1):
        if tuple(ids[i:i + n]) == pattern:
            return i
    return -1


class ReasoningGate:
    """One request's state; ``feed`` each generated token in order."""

    __slots__ = ("tokens", "state", "_tail")

    def __init__(self, tokens: ReasoningTokens, state: str) -> None:
        self.tokens, self.state = tokens, state
        self._tail: list[int] = []  # the last generated tokens, as long as the end delimiter

    @property
    def constrained(self) -> bool:
        """Whether the next token is sampled under the grammar's mask."""
        return self.state != "reasoning"

    @property
    def also_allowed(self) -> int | None:
        """A token the mask allows beside the grammar's: the start delimiter, while the output may open a block."""
        return self.tokens.start[0] if self.state == "start" else None

    def feed(self, token_id: int) -> bool:
        """Takes one generated token; True when it belongs to the answer (and so to the grammar)."""
        if self.state == "answer":
            return True
        if self.state == "start":
            if token_id == self.tokens.start[0]:
                self.state = "reasoning"
                return False
            self.state = "answer"
            return True
        end = self.tokens.end
        self._tail = (self._tail + [token_id])[-len(end):]
        if tuple(self._tail) == end:
            self.state = "answer"
        return False
