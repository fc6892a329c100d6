"""LLM: the offline batch API, a drop-in for vllm.LLM (generate, chat, get_tokenizer)."""
from __future__ import annotations

import itertools
import logging
from typing import Any, Sequence

from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.processor import PromptType
from pagedllm.engine_args import EngineArgs
from pagedllm.model_loader.tokenizer import chat_prompt_ids
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.vllm_only_args import pop_vllm_only_args

logger = logging.getLogger("pagedllm")


class LLM:
    def __init__(
        self,
        model: str | None = None,
        tokenizer: str | None = None,
        dtype: str = "auto",
        seed: int = 0,
        max_model_len: int | None = None,
        block_size: int = 16,
        kv_cache_memory_bytes: int | None = None,
        gpu_memory_utilization: float = 0.9,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        enable_prefix_caching: bool = True,
        enable_chunked_prefill: bool = True,
        load_format: str = "auto",
        device: str = "auto",
        skip_tokenizer_init: bool = False,
        enforce_eager: bool = False,
        trust_remote_code: bool = False,
        **kwargs: Any,
    ) -> None:
        pop_vllm_only_args(kwargs)  # vLLM options with nothing to change here (or an error naming them)
        args = EngineArgs(
            model=model,
            tokenizer=tokenizer,
            dtype=dtype,
            seed=seed,
            max_model_len=max_model_len,
            block_size=block_size,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            gpu_memory_utilization=gpu_memory_utilization,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=enable_prefix_caching,
            enable_chunked_prefill=enable_chunked_prefill,
            load_format=load_format,
            device=device,
            skip_tokenizer_init=skip_tokenizer_init,
            enforce_eager=enforce_eager,
            trust_remote_code=trust_remote_code,
            **kwargs,
        )
        self.llm_engine = LLMEngine.from_engine_args(args)
        self._counter = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.get_tokenizer()

    def get_default_sampling_params(self) -> SamplingParams:
        return self.llm_engine.processor.default_sampling_params()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(
                    f"sampling_params has {len(params)} entries but there are {len(prompts)} prompts; "
                    "pass one SamplingParams or one per prompt"
                )
        # A bad prompt raises before running anything and withdraws the requests queued before it.
        engine = self.llm_engine
        ids = []
        try:
            for prompt, p in zip(prompts, params):
                rid = str(next(self._counter))
                engine.add_request(rid, prompt, p)
                ids.append(rid)
        except Exception:
            engine.abort_request(ids)
            raise
        return self._run_engine(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        tok = self.get_tokenizer()
        if tok is None:
            raise ValueError("chat needs a tokenizer; this LLM was built with skip_tokenizer_init")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conv in conversations:
            ids = chat_prompt_ids(
                tok,
                conv,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                **(chat_template_kwargs or {}),
            )
            prompts.append({"prompt_token_ids": list(ids)})
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True)
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            engine.abort_request([r for r in request_ids if r not in results])
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[r] for r in request_ids]
