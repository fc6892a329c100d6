"""/v1/completions: prompts (text, token ids, or batches of either) to text completions, whole or streamed."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from pagedllm.engine.async_llm import EngineDeadError, RequestFailedError
from pagedllm.entrypoints.openai.blocking_pool import run_blocking
from pagedllm.entrypoints.openai.errors import OpenAIError, bad_request
from pagedllm.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    PromptTokensDetails,
    Usage,
)
from pagedllm.entrypoints.openai.structured_request import (
    Constraint,
    compile_failure,
    compile_failure_event,
    name_engine_error,
    one_constraint,
    request_constraints,
)
from pagedllm.entrypoints.openai.serving_engine import (
    OpenAIServing,
    Prompt,
    StreamingResult,
    merge_streams,
    random_id,
    request_failed,
    sse_chunk,
    stream_failure,
    top_entries,
)
from pagedllm.outputs import Logprob


@dataclass
class _ChoiceState:
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text_offset: int = 0  # streaming: where the next token's text starts
    started: bool = False


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, req: CompletionRequest) -> CompletionResponse | StreamingResult:
        """A CompletionResponse, or (stream=True) SSE lines ending in [DONE]."""
        self.check_model(req.model)
        if req.suffix is not None:
            raise bad_request("suffix is not supported", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request(f"best_of must equal n ({req.n}) or be omitted, got {req.best_of}", param="best_of")
        if req.echo and req.logprobs is not None:
            raise bad_request("echo together with logprobs is not supported", param="echo")
        constraint = one_constraint(req, request_constraints(req))
        if constraint:
            constraint.params.after_reasoning = False  # a completion's text is not split into reasoning
        params = self.sampling_params(req, req.max_tokens, req.logprobs, rename={},
                                      structured_outputs=constraint.params if constraint else None)
        prompts = await self._prompts(req.prompt, req.n)
        for p in prompts:
            self.check_context(len(p.token_ids), req.max_tokens, "prompt", "max_tokens")
        request_id = req.request_id or random_id("cmpl")
        try:
            streams = self.open_streams(request_id, prompts, params)
        except OpenAIError as e:
            raise name_engine_error(e, constraint) from None
        if req.stream:
            return StreamingResult(self._stream(req, request_id, prompts, streams, constraint), streams)
        return await self._full(req, request_id, prompts, streams, constraint)

    async def _prompts(self, prompt: Any, n: int) -> list[Prompt]:
        if isinstance(prompt, str):
            items: list[Any] = [prompt]
        elif prompt and all(isinstance(t, int) for t in prompt):
            items = [list(prompt)]
        else:
            items = list(prompt)
        if not items:
            raise bad_request("prompt must not be empty", param="prompt")
        self.check_num_sequences(len(items), n)
        texts = [item for item in items if isinstance(item, str)]
        if texts and self.tokenizer is None:
            raise bad_request("text prompts need a tokenizer; send token ids", param="prompt")
        # Tokenizing is the one step whose time grows with the body (seconds for 15 MB): off the loop.
        ids = iter(await run_blocking(self._tokenize_all, texts) if texts else [])
        return [Prompt(item, next(ids)) if isinstance(item, str) else Prompt(None, list(item)) for item in items]

    def _tokenize_all(self, texts: list[str]) -> list[list[int]]:
        return [self.engine.processor.tokenize_prompt(text)[1] for text in texts]

    def _prompt_text(self, p: Prompt) -> str:
        if p.text is not None:
            return p.text
        return self.tokenizer.decode(p.token_ids) if self.tokenizer is not None else ""

    def _logprobs(self, st: _ChoiceState, token_ids: list[int], lps: list[dict[int, Logprob]], k: int) -> CompletionLogprobs:
        out = CompletionLogprobs()
        for tok, pos in zip(token_ids, lps):
            chosen = pos.get(tok)
            text = self.token_text(tok)
            out.tokens.append(text)
            out.token_logprobs.append(chosen.logprob if chosen is not None else None)
            out.top_logprobs.append({self.token_text(t): lp.logprob for t, lp in top_entries(pos, k)})
            out.text_offset.append(st.text_offset)
            st.text_offset += len(text)
        return out

    def _usage(self, prompts: list[Prompt], num_completion: int, cached: dict[int, int]) -> Usage:
        num_prompt = sum(len(p.token_ids) for p in prompts)
        return Usage(
            prompt_tokens=num_prompt,
            completion_tokens=num_completion,
            total_tokens=num_prompt + num_completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(cached.values())),
        )

    async def _full(self, req: CompletionRequest, request_id: str, prompts: list[Prompt], streams,
                    constraint: Constraint | None = None) -> CompletionResponse:
        n = req.n
        states = [_ChoiceState() for _ in range(len(prompts) * n)]
        cached: dict[int, int] = {}
        try:
            async for i, out in merge_streams(streams):
                cached[i] = out.num_cached_tokens
                for c in out.outputs:
                    st = states[i * n + c.index]
                    st.text.append(c.text)
                    st.token_ids.extend(c.token_ids)
                    if c.logprobs:
                        st.logprobs.extend(c.logprobs)
                    if c.finish_reason is not None:
                        st.finish_reason, st.stop_reason = c.finish_reason, c.stop_reason
        except EngineDeadError as e:
            raise OpenAIError(500, f"The engine died while serving the request: {e}", code="engine_dead") from None
        except RequestFailedError as e:
            raise compile_failure(e, constraint) or request_failed(e) from None
        choices = []
        for idx, st in enumerate(states):
            text = "".join(st.text)
            if req.echo:
                text = self._prompt_text(prompts[idx // n]) + text
            lp = self._logprobs(st, st.token_ids, st.logprobs, req.logprobs) if req.logprobs is not None else None
            choices.append(
                CompletionChoice(index=idx, text=text, logprobs=lp, finish_reason=st.finish_reason, stop_reason=st.stop_reason)
            )
        usage = self._usage(prompts, sum(len(st.token_ids) for st in states), cached)
        return CompletionResponse(id=request_id, model=self.model_name, choices=choices, usage=usage)

    async def _stream(self, req: CompletionRequest, request_id: str, prompts: list[Prompt], streams,
                      constraint: Constraint | None = None) -> AsyncIterator[str]:
        n = req.n
        states = [_ChoiceState() for _ in range(len(prompts) * n)]
        cached: dict[int, int] = {}
        num_tokens = 0
        try:
            async for i, out in merge_streams(streams):
                cached[i] = out.num_cached_tokens
                for c in out.outputs:
                    idx = i * n + c.index
                    st = states[idx]
                    if st.finish_reason is not None:
                        continue  # finished earlier; later DELTA outputs repeat its finish_reason
                    text = c.text
                    if req.echo and not st.started:
                        text = self._prompt_text(prompts[i]) + text
                    if not text and not c.token_ids and c.finish_reason is None:
                        continue
                    st.started = True
                    num_tokens += len(c.token_ids)
                    lp = None
                    if req.logprobs is not None and c.logprobs is not None:
                        lp = self._logprobs(st, c.token_ids, c.logprobs, req.logprobs)
                    st.finish_reason = c.finish_reason
                    choice = CompletionChoice(
                        index=idx, text=text, logprobs=lp, finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason if c.finish_reason is not None else None,
                    )
                    chunk = CompletionResponse(id=request_id, model=self.model_name, choices=[choice])
                    yield sse_chunk(chunk)
            if req.stream_options is not None and req.stream_options.include_usage:
                chunk = CompletionResponse(
                    id=request_id, model=self.model_name, choices=[], usage=self._usage(prompts, num_tokens, cached)
                )
                yield sse_chunk(chunk)
        except Exception as e:  # noqa: BLE001 - the headers are sent: the error goes in the stream
            yield compile_failure_event(e, constraint) or stream_failure(e, "/v1/completions (stream)")
        yield "data: [DONE]\n\n"

