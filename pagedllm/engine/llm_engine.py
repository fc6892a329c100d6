"""LLMEngine: the synchronous engine (processor -> engine core -> output processor) behind LLM.

With data_parallel_size K > 1 the engine cores run as K processes behind a DPCoreClient (the one the
server uses) instead of one EngineCore in this process; step() then returns whatever any core sent.
"""
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
    def __init__(
        self,
        config: EngineConfig,
        executor: Executor | None = None,
        tokenizer: Any | None = None,
        dp_client: Any | None = None,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer if tokenizer is not None else get_tokenizer(config.model_config)
        self.processor = Processor(config.model_config, self.tokenizer)
        self.dp_client = dp_client
        self.engine_core: EngineCore | None = None
        if dp_client is None:
            self.engine_core = EngineCore(config, executor or make_executor(config))
            # Structured outputs compile against this tokenizer instead of loading it a second time.
            self.engine_core.tokenizer = self.tokenizer
        self.output_processor = OutputProcessor(self.tokenizer)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLMEngine:
        if engine_args.data_parallel_size == 1:
            return cls(engine_args.create_engine_config())
        # Lazy: the process plumbing (zmq, msgspec) is needed only with several cores.
        from pagedllm.engine.dp_client import DPCoreClient

        engine_args._parallel_config().check()  # names a bad size before K processes start
        if engine_args.enable_expert_parallel:
            # The model's shapes against dp x tp expert-parallel ranks too (cores in lockstep meet at start-up).
            engine_args.create_engine_config()
        client = DPCoreClient(engine_args)
        try:
            config = engine_args.create_engine_config()
            client.wait_ready()
            return cls(config, dp_client=client)
        except BaseException:
            client.shutdown()
            raise

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
            (self.dp_client or self.engine_core).add_request(child)

    def abort_request(self, request_ids: list[str]) -> None:
        children = self.output_processor.abort_requests(request_ids)
        if self.dp_client is not None:
            self.dp_client.abort(children)
        else:
            self.engine_core.abort_requests(children)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        if self.dp_client is not None:
            core_outputs = [o for _, msg in self.dp_client.recv_sync() for o in msg.outputs]
        else:
            core_outputs = self.engine_core.step()
        outputs, stops = self.output_processor.process_outputs(core_outputs)
        for child_id, stop in stops:
            (self.dp_client or self.engine_core).finish_by_stop_string(child_id, stop)
        return outputs

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def shutdown(self) -> None:
        """Stops the engine core's workers (worker processes of a multiprocess executor), or the cores."""
        if self.dp_client is not None:
            self.dp_client.shutdown()
        else:
            self.engine_core.shutdown()
