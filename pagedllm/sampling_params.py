"""SamplingParams: how one request is decoded, validated up front with errors that name the field; and
StructuredOutputsParams, its one output constraint (JSON schema, regex, choice, grammar).

StructuredOutputsParams' field names follow vLLM's. The checks here are the cheap, model-free ones
(types, exactly one kind of constraint); whether a schema, regex or grammar compiles is checked by the
structured-output backend against the model's tokenizer.
"""
from __future__ import annotations

import copy
import hashlib
import json as _json
from dataclasses import dataclass, field, fields
from typing import Any

# The constraint kinds; exactly one of them must be set.
CONSTRAINT_FIELDS = ("json", "regex", "choice", "grammar", "json_object")


def _fail_constraint(name: str, value: Any, rule: str) -> None:
    shown = repr(value)
    if len(shown) > 200:
        shown = shown[:200] + "..."
    raise ValueError(f"structured_outputs.{name} must be {rule}, got {shown}")


@dataclass
class StructuredOutputsParams:
    """One constraint on a request's output; exactly one of json, regex, choice, grammar, json_object."""

    # A JSON schema, as a dict or as its JSON text.
    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    # A grammar in GBNF / EBNF (xgrammar's dialect, which takes llama.cpp's GBNF).
    grammar: str | None = None
    # Any JSON object, no schema.
    json_object: bool | None = None
    # Without whitespace between JSON tokens (compact output, fewer tokens).
    disable_any_whitespace: bool = False
    # With a reasoning parser configured, whether the constraint waits for the reasoning to end (chat output,
    # split into reasoning and answer) or applies from the first token (False: the completions API, or a
    # chat request with thinking turned off, whose output has no reasoning to skip).
    after_reasoning: bool = True

    def __post_init__(self) -> None:
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    parsed = _json.loads(self.json)
                except ValueError as e:
                    _fail_constraint("json", self.json, f"a JSON schema (an object or its JSON text); it does not parse: {e}")
                if not isinstance(parsed, (dict, bool)):
                    _fail_constraint("json", self.json, "a JSON schema: a JSON object (or true/false)")
            elif not isinstance(self.json, (dict, bool)):
                _fail_constraint("json", self.json, "a JSON schema: a dict or its JSON text")
        if self.regex is not None and (not isinstance(self.regex, str) or self.regex == ""):
            _fail_constraint("regex", self.regex, "a non-empty string")
        if self.choice is not None:
            if isinstance(self.choice, (str, bytes)) or not isinstance(self.choice, (list, tuple)):
                _fail_constraint("choice", self.choice, "a non-empty list of strings")
            self.choice = list(self.choice)
            if not self.choice or not all(isinstance(c, str) for c in self.choice):
                _fail_constraint("choice", self.choice, "a non-empty list of strings")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            _fail_constraint("grammar", self.grammar, "a non-empty GBNF/EBNF string")
        if self.json_object is not None and not isinstance(self.json_object, bool):
            _fail_constraint("json_object", self.json_object, "a boolean")
        if not isinstance(self.disable_any_whitespace, bool):
            _fail_constraint("disable_any_whitespace", self.disable_any_whitespace, "a boolean")
        if not isinstance(self.after_reasoning, bool):
            _fail_constraint("after_reasoning", self.after_reasoning, "a boolean")
        kinds = self.kinds()
        if len(kinds) != 1:
            got = ", ".join(kinds) if kinds else "none"
            raise ValueError(
                "structured_outputs must set exactly one of "
                f"{', '.join(CONSTRAINT_FIELDS)}; got {len(kinds)} ({got})"
            )

    def kinds(self) -> list[str]:
        """The constraint fields that are set (json_object counts only when true)."""
        set_ = []
        for name in CONSTRAINT_FIELDS:
            value = getattr(self, name)
            if name == "json_object":
                if value:
                    set_.append(name)
            elif value is not None:
                set_.append(name)
        return set_

    @property
    def kind(self) -> str:
        return self.kinds()[0]

    def to_dict(self) -> dict[str, Any]:
        """Plain data (for the wire to the engine core)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_value(cls, value: StructuredOutputsParams | dict[str, Any]) -> StructuredOutputsParams:
        """Accepts the dataclass itself or its dict form (vLLM's extra-body shape, or to_dict's)."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(
                f"structured_outputs must be a StructuredOutputsParams or a mapping, got {type(value).__name__}"
            )
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"structured_outputs has unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        return cls(**value)

    def cache_key(self) -> str:
        """A digest of the constraint: equal constraints share one compiled grammar."""
        spec = self.to_dict()
        del spec["after_reasoning"]  # where the grammar starts, not what it is
        if isinstance(spec["json"], str):
            # Two spellings of one schema (key order, spacing) compile to the same grammar.
            spec["json"] = _json.loads(spec["json"])
        text = _json.dumps(spec, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        return hashlib.sha256(text.encode()).hexdigest()


# vLLM's limit on returned logprobs per token; larger values cost a vocabulary-wide sort per step.
MAX_LOGPROBS = 20
_SAMPLING_EPS = 1e-5
# The sampler divides float32 logits by the temperature: a larger value becomes infinity there, and
# logits / infinity is NaN for masked (-inf) tokens.
MAX_TEMPERATURE = 3.4028234663852886e38
# Penalised positive logits are divided by the repetition penalty: a tiny one overflows float32 (1e-45
# is 0 there, and 1 / 0 is infinite). At this bound a logit of 1e30 still stays finite.
MIN_REPETITION_PENALTY = 0.01


def _fail(name: str, value: Any, rule: str) -> None:
    raise ValueError(f"{name} must be {rule}, got {value!r}")


@dataclass
class SamplingParams:
    """Decoding rules of one request. Field names, defaults and ranges follow vLLM's SamplingParams."""

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    detokenize: bool = True
    # A constraint on the output (JSON schema, regex, choice, grammar); a dict is taken as its fields.
    structured_outputs: StructuredOutputsParams | None = None
    # Filled by the engine: the model's EOS ids, kept apart from the user's stop_token_ids.
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is not None:
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError, AttributeError):
                _fail("logit_bias", self.logit_bias, "a mapping of integer token ids to float biases")
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.structured_outputs is not None:
            # The wire to the engine core carries it as a dict (core_messages.params_to_dict).
            self.structured_outputs = StructuredOutputsParams.from_value(self.structured_outputs)
        self._verify()
        if self.temperature < _SAMPLING_EPS:
            # Greedy: the other truncation knobs cannot change an argmax, so normalise them.
            self.top_p, self.top_k, self.min_p = 1.0, -1, 0.0
        self.all_stop_token_ids = set(self.stop_token_ids)

    def _verify(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            _fail("n", self.n, "an integer >= 1")
        if not -2.0 <= self.presence_penalty <= 2.0:
            _fail("presence_penalty", self.presence_penalty, "in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            _fail("frequency_penalty", self.frequency_penalty, "in [-2, 2]")
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= 2.0:
            _fail("repetition_penalty", self.repetition_penalty, f"in [{MIN_REPETITION_PENALTY}, 2]")
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            _fail("temperature", self.temperature, f"a finite number in [0, {MAX_TEMPERATURE:.4g}] (float32's largest)")
        if not 0.0 < self.top_p <= 1.0:
            _fail("top_p", self.top_p, "in (0, 1]")
        if not isinstance(self.top_k, int) or not (self.top_k == -1 or self.top_k >= 1):
            # vLLM accepts 0 as "disabled" too; we keep the clearer -1 and map 0 to it.
            if self.top_k == 0:
                self.top_k = -1
            else:
                _fail("top_k", self.top_k, "-1 (disabled) or an integer >= 1")
        if not 0.0 <= self.min_p <= 1.0:
            _fail("min_p", self.min_p, "in [0, 1]")
        if self.seed is not None and not isinstance(self.seed, int):
            _fail("seed", self.seed, "an integer or None")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            _fail("max_tokens", self.max_tokens, "an integer >= 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            _fail("min_tokens", self.min_tokens, "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            _fail("min_tokens", self.min_tokens, f"<= max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS):
                _fail(name, value, f"an integer in [0, {MAX_LOGPROBS}]")
        for s in self.stop:
            if not isinstance(s, str) or s == "":
                _fail("stop", self.stop, "a list of non-empty strings")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or t < 0:
                _fail("stop_token_ids", self.stop_token_ids, "a list of non-negative token ids")
        if self.allowed_token_ids is not None and len(self.allowed_token_ids) == 0:
            _fail("allowed_token_ids", self.allowed_token_ids, "a non-empty list of token ids")
        if self.logit_bias:
            for tok, bias in self.logit_bias.items():
                if not -100.0 <= bias <= 100.0:
                    _fail(f"logit_bias[{tok}]", bias, "in [-100, 100]")

    def verify_vocab(self, vocab_size: int) -> None:
        """Checks token ids against the model's vocabulary (known only once the model is loaded)."""
        for name, ids in (
            ("logit_bias", list(self.logit_bias or {})),
            ("allowed_token_ids", self.allowed_token_ids or []),
            ("stop_token_ids", self.stop_token_ids),
        ):
            for t in ids:
                if not 0 <= t < vocab_size:
                    raise ValueError(
                        f"{name} holds token id {t}, outside the vocabulary [0, {vocab_size})"
                    )

    @property
    def greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        return (
            abs(self.presence_penalty) >= _SAMPLING_EPS
            or abs(self.frequency_penalty) >= _SAMPLING_EPS
            or abs(self.repetition_penalty - 1.0) >= _SAMPLING_EPS
        )

    def clone(self) -> SamplingParams:
        return copy.deepcopy(self)
