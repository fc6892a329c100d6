"""The shipped chat templates: each family's exact format, Qwen3's and Llama 3's equal to their real
tokenizers' own templates, and which template a tokenizer without one is given (and when none is)."""
from __future__ import annotations

import logging

import pytest
import torch
from transformers import LlamaConfig, MistralConfig, Qwen3Config
from transformers.utils.chat_template_utils import render_jinja_template

from pagedllm.chat_templates import ARCHITECTURE_FAMILIES, FAMILIES, choose_family, load_template
from pagedllm.config import ModelConfig
from pagedllm.model_loader.tokenizer import get_tokenizer
from pagedllm.models.registry import supported_architectures

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "Name a color."},
]

# family -> (bos_token, eos_token, the conversation above with a generation prompt), as each family's
# model card or tokenizer writes it.
EXPECTED = {
    "llama3": ("<|begin_of_text|>", "<|eot_id|>",
               "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>"
               "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
               "<|start_header_id|>assistant<|end_header_id|>\n\nHello! How can I help?<|eot_id|>"
               "<|start_header_id|>user<|end_header_id|>\n\nName a color.<|eot_id|>"
               "<|start_header_id|>assistant<|end_header_id|>\n\n"),
    "mistral": ("<s>", "</s>",
                "<s>[INST] You are terse.\n\nHi there [/INST] Hello! How can I help?</s>[INST] Name a color. [/INST]"),
    "qwen2": ("", "<|im_end|>",
              "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
              "<|im_start|>assistant\nHello! How can I help?<|im_end|>\n<|im_start|>user\nName a color.<|im_end|>\n"
              "<|im_start|>assistant\n"),
    "qwen3": ("", "<|im_end|>",
              "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
              "<|im_start|>assistant\nHello! How can I help?<|im_end|>\n<|im_start|>user\nName a color.<|im_end|>\n"
              "<|im_start|>assistant\n"),
    "phi3": ("<s>", "<|endoftext|>",
             "<|system|>\nYou are terse.<|end|>\n<|user|>\nHi there<|end|>\n<|assistant|>\nHello! How can I help?<|end|>\n"
             "<|user|>\nName a color.<|end|>\n<|assistant|>\n"),
    "gemma3": ("<bos>", "<eos>",
               "<bos><start_of_turn>user\nYou are terse.\n\nHi there<end_of_turn>\n"
               "<start_of_turn>model\nHello! How can I help?<end_of_turn>\n"
               "<start_of_turn>user\nName a color.<end_of_turn>\n<start_of_turn>model\n"),
}


def _render(family: str, messages: list[dict], **kwargs) -> str:
    bos, eos, _ = EXPECTED[family]
    rendered, _ = render_jinja_template(
        conversations=[messages], chat_template=load_template(family), bos_token=bos, eos_token=eos, **kwargs
    )
    return rendered[0]


def test_every_supported_architecture_has_a_family() -> None:
    assert set(ARCHITECTURE_FAMILIES) == set(supported_architectures())
    assert set(EXPECTED) == set(FAMILIES)


@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_renders_the_family_format(family: str) -> None:
    assert _render(family, CONVERSATION, add_generation_prompt=True) == EXPECTED[family][2]


@pytest.mark.parametrize("family", ["llama3", "qwen2", "qwen3", "phi3", "gemma3"])
def test_generation_prompt_only_when_asked(family: str) -> None:
    with_prompt = _render(family, CONVERSATION, add_generation_prompt=True)
    without = _render(family, CONVERSATION, add_generation_prompt=False)
    assert with_prompt.startswith(without) and len(with_prompt) > len(without)


@pytest.mark.parametrize("family", ["mistral", "gemma3"])
def test_no_system_turn_and_alternation_enforced(family: str) -> None:
    # Without a system message the first user turn starts right after the BOS.
    plain = _render(family, CONVERSATION[1:], add_generation_prompt=True)
    assert plain == EXPECTED[family][2].replace("You are terse.\n\n", "")
    with pytest.raises(Exception, match="alternate"):
        _render(family, [CONVERSATION[1], CONVERSATION[1]], add_generation_prompt=True)


# Conversations on which the shipped Qwen3 and Llama 3 templates must equal the real tokenizers'.
REAL_TEMPLATE_CASES = [
    (CONVERSATION, {}),
    (CONVERSATION[1:2], {}),
    ([{"role": "user", "content": "  padded \n"}], {}),
    # Qwen3's reasoning: earlier turns lose their <think> block, the one after the last user keeps it.
    (CONVERSATION[1:3] + [{"role": "user", "content": "Why?"},
                          {"role": "assistant", "content": "<think>\nbecause\n</think>\n\nIt is."}], {}),
    (CONVERSATION, {"enable_thinking": False}),
]


@pytest.mark.parametrize("name", ["qwen3", "llama3"])
@pytest.mark.parametrize("case", range(len(REAL_TEMPLATE_CASES)))
def test_equals_the_real_tokenizers_template(name: str, case: int) -> None:
    from assets import load_tokenizer

    tok = load_tokenizer(name)
    assert tok.chat_template and tok.chat_template != load_template(name)
    messages, kwargs = REAL_TEMPLATE_CASES[case]
    # The Llama 3 tokenizer's template always ends in the assistant header; ours only when asked.
    for add in ([True] if name == "llama3" else [True, False]):
        theirs = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add, **kwargs)
        ours = tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add, chat_template=load_template(name), **kwargs
        )
        assert ours == theirs


def test_choose_family_needs_the_markers_in_the_vocabulary() -> None:
    gemma = choose_family(["Gemma3ForCausalLM"], {"<start_of_turn>", "<end_of_turn>"})
    assert gemma.family.name == "gemma3" and gemma.architecture == "Gemma3ForCausalLM"
    # A Llama without Llama 3's header tokens (Llama 2 and the like) gets no template.
    llama2 = choose_family(["LlamaForCausalLM"], {"<s>", "</s>", "[INST]"})
    assert llama2.family is None and llama2.missing == ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
    assert choose_family(["MistralForCausalLM"], set()).family.name == "mistral"
    assert choose_family(["GPT2LMHeadModel", "Qwen3ForCausalLM"], {"<|im_start|>", "<|im_end|>"}).family.name == "qwen3"
    assert choose_family(["GPT2LMHeadModel"], set()) is None


def _model_config(path: str, hf_config) -> ModelConfig:
    return ModelConfig(model=path, tokenizer=None, hf_config=hf_config, dtype=torch.float32, max_model_len=64)


def test_tokenizer_without_template_gets_its_family_template(caplog) -> None:
    from assets import tokenizer_dir

    path = str(tokenizer_dir("mistral"))  # the Mistral 7B v0.1 tokenizer: no chat template of its own
    config = MistralConfig(architectures=["MistralForCausalLM"])
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        tok = get_tokenizer(_model_config(path, config))
    assert tok.chat_template == load_template("mistral")
    lines = [r.getMessage() for r in caplog.records if "chat template" in r.getMessage()]
    assert len(lines) == 1 and "Mistral [INST]" in lines[0] and "MistralForCausalLM" in lines[0]
    ids = tok.apply_chat_template(CONVERSATION[1:2], add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert ids == tok.encode("<s>[INST] Hi there [/INST]", add_special_tokens=False) and ids[0] == tok.bos_token_id


def test_family_without_its_markers_keeps_the_error(caplog) -> None:
    from assets import tokenizer_dir

    # A Llama-shaped model with the (template-less) Mistral vocabulary: no Llama 3 header tokens.
    config = LlamaConfig(architectures=["LlamaForCausalLM"])
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        tok = get_tokenizer(_model_config(str(tokenizer_dir("mistral")), config))
    assert tok.chat_template is None
    assert any("<|start_header_id|>" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="chat_template is not set"):
        tok.apply_chat_template(CONVERSATION[1:2], tokenize=False)


def test_checkpoint_template_wins(caplog) -> None:
    from assets import load_tokenizer, tokenizer_dir

    own = load_tokenizer("qwen3").chat_template
    config = Qwen3Config(architectures=["Qwen3ForCausalLM"])
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        tok = get_tokenizer(_model_config(str(tokenizer_dir("qwen3")), config))
    assert tok.chat_template == own
    assert not [r for r in caplog.records if "chat template" in r.getMessage()]
