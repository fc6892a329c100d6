"""Chat templates of GGUF models: a file's own ``tokenizer.chat_template`` is used, and the default model
(whose file carries none) chats through the shipped Gemma 3 template."""
from __future__ import annotations

import logging

import pytest
import torch

gguf = pytest.importorskip("gguf")

from transformers import Gemma3TextConfig, Qwen2Config  # noqa: E402

from pagedllm import LLM, SamplingParams, envs  # noqa: E402
from pagedllm.chat_templates import load_template  # noqa: E402
from pagedllm.config import ModelConfig  # noqa: E402
from pagedllm.model_loader.tokenizer import get_tokenizer  # noqa: E402

OWN_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
MESSAGES = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Name a color."}]


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _template_lines(messages: list[str]) -> list[str]:
    return [m for m in messages if "chat template" in m]


def _tokenizer_with_log(config: ModelConfig):
    logger = logging.getLogger("pagedllm")
    records, level = _Records(), logger.level
    logger.addHandler(records)
    logger.setLevel(logging.INFO)
    try:
        return get_tokenizer(config), records.messages
    finally:
        logger.removeHandler(records)
        logger.setLevel(level)


def _write_vocab_gguf(path: str, arch: str, tokenizer_model: str, tokens: list[str], types: list[int],
                      merges: list[str] | None = None) -> str:
    """A GGUF holding only a vocabulary and OWN_TEMPLATE (the tokenizer needs no tensors)."""
    w = gguf.GGUFWriter(path, arch)
    w.add_tokenizer_model(tokenizer_model)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if tokenizer_model == "llama":
        w.add_token_scores([0.0] * len(tokens))
    if merges:
        w.add_token_merges(merges)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_chat_template(OWN_TEMPLATE)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _config(path: str, hf_config) -> ModelConfig:
    return ModelConfig(model=path, tokenizer=None, hf_config=hf_config, dtype=torch.float32, max_model_len=64,
                       gguf_file=path)


@pytest.mark.parametrize("kind", ["gemma3", "qwen2"])
def test_the_files_own_template_is_used(kind: str, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(envs, "PAGEDLLM_CACHE", tmp_path / "cache")
    if kind == "gemma3":  # built by pagedllm (and cached: the second load reads the cache entry)
        tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "\u2581", "a", "b", "\u2581a"]
        path = _write_vocab_gguf(str(tmp_path / "g.gguf"), "gemma3", "llama", tokens, [3, 3, 3, 2, 3, 3, 1, 1, 1, 1])
        hf_config = Gemma3TextConfig(architectures=["Gemma3ForCausalLM"])
    else:  # built by transformers from the GGUF's byte-level BPE
        tokens = ["<|endoftext|>", "<|im_end|>", "<|im_start|>", "a", "b", "ab", "\u0120", "\u0120a"]
        path = _write_vocab_gguf(str(tmp_path / "q.gguf"), "qwen2", "gpt2", tokens, [3, 3, 3, 1, 1, 1, 1, 1],
                                 merges=["a b", "\u0120 a"])
        hf_config = Qwen2Config(architectures=["Qwen2ForCausalLM"])
    for _ in range(2):
        tok, log = _tokenizer_with_log(_config(path, hf_config))
        assert tok.chat_template == OWN_TEMPLATE and not _template_lines(log)
        text = tok.apply_chat_template(MESSAGES, tokenize=False)
        assert text == "[system] Answer in one word.\n[user] Name a color.\n"


# ------------------------------------------------------------------------------------ the default model


@pytest.fixture(scope="module")
def default_llm():
    """The default model (as `pagedllm serve` with no model loads it) and the log lines of its loading."""
    from pagedllm.model_loader.default_model import default_model_path

    try:
        path = default_model_path()
    except RuntimeError as e:  # the model package is not installed
        pytest.skip(str(e))
    threads = torch.get_num_threads()
    # One thread: two OpenMP threads on a shared 2-core machine spin-wait on each other.
    torch.set_num_threads(1)
    logger = logging.getLogger("pagedllm")
    records, level = _Records(), logger.level
    logger.addHandler(records)
    logger.setLevel(logging.INFO)
    try:
        llm = LLM(model=path, dtype="float32", device="cpu", max_model_len=128, kv_cache_memory_bytes=1 << 23)
    finally:
        logger.removeHandler(records)
        logger.setLevel(level)
    yield llm, records.messages
    torch.set_num_threads(threads)


def test_default_model_gets_the_gemma3_template(default_llm) -> None:
    llm, log = default_llm
    tok = llm.get_tokenizer()
    assert tok.chat_template == load_template("gemma3")
    (line,) = _template_lines(log)
    assert "Gemma 3" in line and "gemma3.jinja" in line and "general.architecture 'gemma3'" in line
    # The turn markers are single special tokens of the vocabulary, and <bos> opens the prompt once.
    start, end = tok.convert_tokens_to_ids(["<start_of_turn>", "<end_of_turn>"])
    assert tok.encode("<start_of_turn>user\nhi<end_of_turn>", add_special_tokens=False)[0] == start
    assert tok.encode("<end_of_turn>", add_special_tokens=False) == [end]
    rendered = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert rendered == ("<bos><start_of_turn>user\nAnswer in one word.\n\nName a color.<end_of_turn>\n"
                        "<start_of_turn>model\n")
    ids = tok.encode(rendered, add_special_tokens=False)
    assert ids[:2] == [tok.bos_token_id, start] and ids.count(tok.bos_token_id) == 1 and ids.count(end) == 1


def test_default_model_chats(default_llm) -> None:
    llm, _ = default_llm
    out = llm.chat(MESSAGES, SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    assert out.prompt_token_ids == tok.encode(
        tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False), add_special_tokens=False
    )
    assert out.outputs[0].token_ids and out.outputs[0].text.strip()


def test_a_given_template_wins_over_the_shipped_one(default_llm) -> None:
    llm, _ = default_llm
    tok = llm.get_tokenizer()
    out = llm.chat(MESSAGES, SamplingParams(max_tokens=1), use_tqdm=False, chat_template=OWN_TEMPLATE)[0]
    assert out.prompt_token_ids == tok.encode("[system] Answer in one word.\n[user] Name a color.\n",
                                              add_special_tokens=False)
