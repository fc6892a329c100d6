"""Processor: turns user prompts and SamplingParams into validated engine-core Requests."""
from __future__ import annotations

import hashlib
import itertools
import random
from dataclasses import dataclass
from typing import Any, Union

from pagedllm.config import ModelConfig
from pagedllm.core.request import Request
from pagedllm.sampling_params import SamplingParams

# A prompt is text, {"prompt": text}, or {"prompt_token_ids": [...]} (vLLM's forms).
PromptType = Union[str, dict]
_SEED_MOD = 1 << 31
_END_OF_TURN_TOKENS = ("<end_of_turn>", "<|im_end|>", "<|eot_id|>", "<|end|>")


def derive_seed(seed: int, index: int) -> int:
    """A seed for child ``index`` of a seeded request: distinct per child, stable across runs."""
    digest = hashlib.sha256(f"{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:4], "little") % _SEED_MOD


@dataclass
class ProcessedRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: list[Request]  # n of them; one when n == 1


class Processor:
    def __init__(self, model_config: ModelConfig, tokenizer: Any | None) -> None:
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.vocab_size = model_config.vocab_size
        self.eos_token_ids = self._eos_token_ids()
        self._rng = random.Random(model_config.seed)
        # Numbers each processed request, so that engine-core ids are unique by construction (below).
        self._serial = itertools.count()

    def _eos_token_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        for source in (self.model_config.generation_config.get("eos_token_id"),
                       getattr(self.model_config.hf_config, "eos_token_id", None),
                       getattr(self.tokenizer, "eos_token_id", None)):
            if isinstance(source, int):
                ids.add(source)
            elif isinstance(source, (list, tuple)):
                ids.update(int(t) for t in source)
        if self.model_config.gguf_file and self.tokenizer is not None:
            # GGUF files carry no generation_config.json; like llama.cpp, also end on the
            # end-of-turn tokens the vocabulary defines (Gemma's <end_of_turn>, ChatML's <|im_end|>).
            vocab = self.tokenizer.get_vocab()
            ids.update(vocab[t] for t in _END_OF_TURN_TOKENS if t in vocab)
        return frozenset(ids)

    def default_sampling_params(self) -> SamplingParams:
        """The model's generation_config.json defaults, as vLLM applies them when none are given."""
        gc = self.model_config.generation_config
        kwargs = {k: gc[k] for k in ("temperature", "top_p", "top_k", "repetition_penalty") if k in gc}
        if gc.get("do_sample") is False:
            kwargs["temperature"] = 0.0
        return SamplingParams(**kwargs)

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            text, ids = prompt, None
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text, ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
        elif isinstance(prompt, dict) and "prompt" in prompt:
            text, ids = prompt["prompt"], None
        else:
            raise ValueError(
                f"prompt must be a string, {{'prompt': str}} or {{'prompt_token_ids': [...]}}; got {type(prompt).__name__}"
            )
        if ids is None:
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; with skip_tokenizer_init pass prompt_token_ids")
            ids = self.tokenizer.encode(text)
        return text, ids

    def process(self, request_id: str, prompt: PromptType, params: SamplingParams) -> ProcessedRequest:
        text, ids = self.tokenize_prompt(prompt)
        self._validate(ids, params)
        params = params.clone()
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.eos_token_ids
        params.all_stop_token_ids = stop_ids
        if params.max_tokens is None:
            params.max_tokens = self.model_config.max_model_len - len(ids)
        children = []
        # The core's ids end in "#<serial>" (n == 1) or "#<serial>.<index>": the text after the last "#"
        # holds no "#" and its serial is this request's alone, so no two live ids can be equal, whatever
        # ids clients choose (a parent "0_x" and the first child of "x" once collided).
        serial = next(self._serial)
        for i in range(params.n):
            if params.seed is not None:
                seed = params.seed % _SEED_MOD if params.n == 1 else derive_seed(params.seed, i)
            else:
                seed = self._rng.randrange(_SEED_MOD)
            child_id = f"{request_id}#{serial}" if params.n == 1 else f"{request_id}#{serial}.{i}"
            children.append(Request(child_id, ids, params, seed, eos_token_ids=self.eos_token_ids))
        return ProcessedRequest(request_id, text, ids, params, children)

    def _validate(self, ids: list[int], params: SamplingParams) -> None:
        max_len = self.model_config.max_model_len
        if len(ids) == 0:
            raise ValueError("the prompt is empty (0 tokens); at least 1 token is required")
        if len(ids) >= max_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens, but max_model_len is {max_len}: the prompt must be "
                f"shorter than max_model_len to leave room for at least one generated token"
            )
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt_token_ids holds token id {bad[0]!r}, outside the vocabulary [0, {self.vocab_size})")
        params.verify_vocab(self.vocab_size)
        if params.structured_outputs is not None:
            # Converting the constraint is cheap and tokenizer-free: a bad schema, regex or grammar is
            # refused here rather than failing later in the engine core.
            from pagedllm.structured_output.grammar import validate

            validate(params.structured_outputs)
