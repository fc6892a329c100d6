"""Chat templates shipped with pagedllm, one per model family, for checkpoints that carry none of their own.

A base model or a GGUF file often has no ``tokenizer.chat_template``; chat then needs the format its
family's instruct models were trained on. The family follows from the model's architecture, and a
template is only offered when the vocabulary holds its turn markers as tokens, since a model whose
vocabulary lacks them was never trained on that format.
"""
from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass
from importlib import resources


@dataclass(frozen=True)
class Family:
    name: str  # the template's file stem
    title: str
    markers: tuple[str, ...]  # turn markers the vocabulary must hold as tokens


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("llama3", "Llama 3 instruct", ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")),
        Family("mistral", "Mistral [INST]", ()),
        Family("qwen2", "Qwen2 ChatML", ("<|im_start|>", "<|im_end|>")),
        Family("qwen3", "Qwen3 ChatML with thinking", ("<|im_start|>", "<|im_end|>")),
        Family("phi3", "Phi-3", ("<|user|>", "<|assistant|>", "<|end|>")),
        Family("gemma3", "Gemma 3", ("<start_of_turn>", "<end_of_turn>")),
    )
}

# HF architecture -> family. Llama checkpoints without Llama 3's header tokens (Llama 1/2 and others
# of the same shape) have no common chat format, so markers decide (see choose_family).
ARCHITECTURE_FAMILIES: dict[str, str] = {
    "LlamaForCausalLM": "llama3",
    "LLaMAForCausalLM": "llama3",
    "MistralForCausalLM": "mistral",
    "MixtralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen2MoeForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "Gemma3ForCausalLM": "gemma3",
}


@dataclass(frozen=True)
class Choice:
    family: Family | None
    architecture: str
    missing: tuple[str, ...] = ()  # the family's markers the vocabulary lacks (then family is None)


def template_path(family: str) -> str:
    """Where the family's template lies inside the installed package (for log lines)."""
    return str(resources.files(__name__).joinpath(f"{family}.jinja"))


def load_template(family: str) -> str:
    if family not in FAMILIES:
        raise KeyError(f"no shipped chat template for {family!r}; shipped: {', '.join(sorted(FAMILIES))}")
    return resources.files(__name__).joinpath(f"{family}.jinja").read_text(encoding="utf-8")


def choose_family(architectures: Sequence[str], vocab: Container[str]) -> Choice | None:
    """The shipped family for the first of ``architectures`` that has one, or None when none has.

    A family whose markers are not all in ``vocab`` is reported in ``Choice.missing`` instead.
    """
    for arch in architectures:
        name = ARCHITECTURE_FAMILIES.get(arch)
        if name is None:
            continue
        family = FAMILIES[name]
        missing = tuple(t for t in family.markers if t not in vocab)
        return Choice(None if missing else family, arch, missing)
    return None
