"""LLMEngine: the synchronous engine (processor -> engine core -> output processor) behind LLM."""
from __future__ import annotations

import logging
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.engine.engine_core import EngineCore
from pagedllm.engine.output_processor import OutputKind, OutputProcessor
from pagedllm.engine.processor import Processor, PromptType
from pagedllm.engine_args import EngineArgs
from pagedllm.executor.base import Executor
from pagedllm.executor.selector import make_executor
from pagedllm.model_loader.tokenizer import get_tokenizer
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger("pagedllm")


class LLMEngine:
    def __init__(self, config: EngineConfig, executor: Executor | None = None, tokenizer: Any | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer if tokenizer is not None else get_tokenizer(config.model_config)
        self.processor = Processor(config.model_config, self.tokenizer)
        self.engine_core = EngineCore(config, executor or make_executor(config))
        # Structured outputs compile against this tokenizer instead of loading it a second time.
        self.engine_core.tokenizer = self.tokenizer
        self.output_processor = OutputProcessor(self.tokenizer)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLMEngine:
        return cls(engine_args.create_engine_config())

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        output_kind: OutputKind = OutputKind.FINAL_ONLY,
    ) -> None:
        processed = self.processor.process(request_id, prompt, params)
        self.output_processor.add_request(processed, output_kind)
        for child in processed.children:
            self.engine_core.add_request(child)

    def abort_request(self, request_ids: list[str]) -> None:
        children = self.output_processor.abort_requests(request_ids)
        self.engine_core.abort_requests(children)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        core_outputs = self.engine_core.step()
        outputs, stops = self.output_processor.process_outputs(core_outputs)
        for child_id, stop in stops:
            self.engine_core.finish_by_stop_string(child_id, stop)
        return outputs

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def shutdown(self) -> None:
        """Stops the engine core's workers (worker processes of a multiprocess executor)."""
        self.engine_core.shutdown()
