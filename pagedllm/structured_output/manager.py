"""StructuredOutputManager: the engine core's side of structured outputs.

- A constrained request waits here, outside the scheduler, until its grammar is compiled (so it never
  holds up the batch), then enters the scheduler's queue with a GrammarMatcher of its own (``n > 1``
  children each get one; prefix-cache hits change nothing, since the matcher follows output tokens).
- Each step, one int32 bitmask holds a row of allowed tokens for every constrained request the step
  samples; it travels to the runner on the SchedulerOutput.
- Accepted tokens advance the matchers; a matcher that reaches its end finishes the request ("stop").
  A preempted request keeps its output tokens (it is recomputed, not rewound), so its matcher stays as
  it is: nothing to roll back.
"""
from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any

from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler_output import EngineCoreOutput, SchedulerOutput
from pagedllm.structured_output.reasoning import ReasoningTokens, reasoning_markers

if TYPE_CHECKING:
    import xgrammar as xgr

    from pagedllm.config import ModelConfig
    from pagedllm.structured_output.compiler import GrammarCompiler

# xgrammar (and the compiler module) are imported on the first constrained request: the import costs
# about a second, which engines that never see a constraint do not pay.


class _Waiting:
    __slots__ = ("request", "key", "future")

    def __init__(self, request: Request, key: str, future: Future) -> None:
        self.request, self.key, self.future = request, key, future


def is_constrained(request: Request) -> bool:
    return request.sampling_params.structured_outputs is not None


class StructuredOutputManager:
    def __init__(self, model_config: ModelConfig, reasoning_parser: str | None = None, **compiler_kwargs: Any) -> None:
        self.model_config = model_config
        self._reasoning_markers = reasoning_markers(reasoning_parser) if reasoning_parser else None
        self._reasoning_tokens: ReasoningTokens | None = None
        self.vocab_size = model_config.vocab_size  # the logits' width, which the bitmask covers
        # The front end's tokenizer when it lives in this process (LLMEngine); else loaded when needed.
        self.tokenizer: Any | None = None
        self._compiler_kwargs = compiler_kwargs
        self._compiler: GrammarCompiler | None = None
        self._waiting: dict[str, _Waiting] = {}
        self._batch_matcher: xgr.BatchGrammarMatcher | None = None
        self._fill_pool: ThreadPoolExecutor | None = None

    @property
    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            from pagedllm.structured_output.compiler import GrammarCompiler

            self._compiler = GrammarCompiler(self._load_tokenizer, self.vocab_size, **self._compiler_kwargs)
        return self._compiler

    def _load_tokenizer(self) -> Any | None:
        if self.tokenizer is None:
            from pagedllm.model_loader.tokenizer import get_tokenizer

            self.tokenizer = get_tokenizer(self.model_config)
        return self.tokenizer

    # ---- requests waiting for their grammar ------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self._waiting:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        key, fut = self.compiler.submit(request.sampling_params.structured_outputs)
        self._waiting[request.request_id] = _Waiting(request, key, fut)

    def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            entry = self._waiting.pop(rid, None)
            if entry is not None:
                entry.request.status = RequestStatus.FINISHED_ABORTED

    def num_waiting(self) -> int:
        return len(self._waiting)

    def has_waiting(self) -> bool:
        return bool(self._waiting)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._waiting

    def poll(self, block_s: float = 0.0) -> tuple[list[Request], list[EngineCoreOutput]]:
        """Requests whose grammar is ready (matcher attached), and final outputs of those that failed.

        ``block_s``: wait up to this long for a compile to finish (when the engine has nothing else to do).
        """
        if not self._waiting:
            return [], []
        self.compiler.expire()
        if block_s > 0 and not any(self._future(e).done() for e in self._waiting.values()):
            wait([self._future(e) for e in self._waiting.values()], timeout=block_s, return_when=FIRST_COMPLETED)
            self.compiler.expire()
        ready, failed = [], []
        from pagedllm.structured_output.compiler import CompileError

        for rid, entry in list(self._waiting.items()):
            fut = self._future(entry)
            if not fut.done():
                continue
            del self._waiting[rid]
            req = entry.request
            try:
                req.grammar_matcher = self._matcher(fut.result(), req)
                req.reasoning_gate = self._gate(req)
            except CompileError as e:
                failed.append(self._fail(req, str(e)))
                continue
            except Exception as e:  # noqa: BLE001 - an unexpected compile failure ends this request only
                failed.append(self._fail(req, f"structured_outputs could not be compiled ({type(e).__name__})"))
                continue
            ready.append(req)
        return ready, failed

    def _future(self, entry: _Waiting) -> Future:
        # The cache's entry replaces a compile that passed its deadline with a failed one.
        return self.compiler.lookup(entry.key) or entry.future

    @staticmethod
    def _fail(req: Request, reason: str) -> EngineCoreOutput:
        req.status, req.stop_reason = RequestStatus.FINISHED_ERROR, reason
        return EngineCoreOutput(req.request_id, [], finish_reason="error", stop_reason=reason)

    @staticmethod
    def _matcher(compiled: xgr.CompiledGrammar, req: Request) -> xgr.GrammarMatcher:
        import xgrammar as xgr

        stop_ids = sorted(req.sampling_params.all_stop_token_ids)
        if not stop_ids:
            # ignore_eos without stop_token_ids: the grammar's end is the request's end.
            return xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
        # The request's own stop tokens end the grammar (Gemma's <end_of_turn>, user stop_token_ids), not
        # only the tokenizer's EOS; accepting one terminates the matcher and the scheduler stops on it.
        return xgr.GrammarMatcher(compiled, override_stop_tokens=stop_ids)

    def _gate(self, req: Request) -> Any | None:
        if self._reasoning_markers is None or not req.sampling_params.structured_outputs.after_reasoning:
            return None
        if self._reasoning_tokens is None:
            self._reasoning_tokens = ReasoningTokens.from_tokenizer(self._reasoning_markers, self._load_tokenizer())
        return self._reasoning_tokens.gate(req.prompt_token_ids)

    # ---- each step -------------------------------------------------------------------------------
    @staticmethod
    def samples_constrained(so: SchedulerOutput, scheduler: Any) -> bool:
        """Whether a step samples a constrained request (right after ``schedule``)."""
        for rid in so.num_scheduled_tokens:
            req = scheduler.requests.get(rid)
            if req is not None and req.num_pending_tokens and req.grammar_matcher is not None:
                if req.reasoning_gate is None or req.reasoning_gate.constrained:
                    return True
        return False

    def fill_bitmask(self, so: SchedulerOutput, scheduler: Any, background: bool = False) -> None:
        """Sets ``so.grammar_rows`` / ``so.grammar_bitmask`` for the constrained requests this step samples.

        ``background``: the bitmask is a Future, filled in a thread while the caller goes on (the runner
        waits for it when it launches the step's sampling, before any matcher moves again).
        """
        matchers, rows, extra = [], {}, []
        for rid in so.num_scheduled_tokens:
            req = scheduler.requests.get(rid)
            # A scheduled request samples this step exactly when it has a pending token; this runs once
            # the step before has been applied (asynchronous mode), so that token is this step's.
            if req is None or req.num_pending_tokens == 0:
                continue
            matcher = getattr(req, "grammar_matcher", None)
            if matcher is None:
                continue
            gate = req.reasoning_gate
            if gate is not None:
                if not gate.constrained:
                    continue  # still reasoning: sampled without a mask
                if gate.also_allowed is not None:
                    extra.append((len(matchers), gate.also_allowed))
            rows[rid] = len(matchers)
            matchers.append(matcher)
        if not matchers:
            return
        so.grammar_rows = rows
        if background:
            if self._fill_pool is None:
                self._fill_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedllm-bitmask")
            so.grammar_bitmask = self._fill_pool.submit(self._fill, matchers, extra)
        else:
            so.grammar_bitmask = self._fill(matchers, extra)

    def _fill(self, matchers: list, extra: list[tuple[int, int]]) -> Any:  # -> int32 [rows, ceil(V / 32)]
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(len(matchers), self.vocab_size)
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(bitmask, 0)
        else:
            if self._batch_matcher is None:
                self._batch_matcher = xgr.BatchGrammarMatcher()
            self._batch_matcher.batch_fill_next_token_bitmask(matchers, bitmask)
        for row, token_id in extra:
            bit = 1 << (token_id % 32)
            bitmask[row, token_id // 32] |= bit - (1 << 32) if bit >= 1 << 31 else bit  # as a signed int32
        return bitmask

    def accept_outputs(self, outputs: list[EngineCoreOutput], scheduler: Any) -> list[EngineCoreOutput]:
        """Advances the matchers by the step's tokens; ends requests whose grammar ended or rejected a token."""
        failed_ids: dict[str, str] = {}
        for out in outputs:
            req = scheduler.requests.get(out.req_id)
            matcher = getattr(req, "grammar_matcher", None) if req is not None else None
            if matcher is None or not out.new_token_ids:
                continue
            gate = req.reasoning_gate
            for tok in out.new_token_ids:
                if gate is not None and not gate.feed(tok):
                    continue  # reasoning, or the delimiter that ends it
                if not matcher.accept_token(tok):
                    failed_ids[out.req_id] = f"the sampled token {tok} does not fit structured_outputs"
                    break
            else:
                if matcher.is_terminated() and out.finish_reason is None:
                    scheduler.finish_requests(out.req_id, RequestStatus.FINISHED_STOPPED)
                    out.finish_reason = "stop"
        if failed_ids:
            # An output that already went into ``outputs`` keeps its tokens; its error comes after it.
            outputs = outputs + scheduler.fail_requests(list(failed_ids), failed_ids)
        return outputs

    def admit(self, scheduler: Any, idle: bool) -> list[EngineCoreOutput]:
        """Moves requests whose grammar is ready into the scheduler; returns final outputs of failed ones.
        ``idle``: the engine has nothing else to run, so it may block briefly on a compile (rather than
        spin on an empty step)."""
        if not self._waiting:
            return []
        ready, failed = self.poll(block_s=0.01 if idle else 0.0)
        for req in ready:
            scheduler.add_request(req)
        return failed

    def shutdown(self) -> None:
        if self._compiler is not None:
            self._compiler.shutdown()
        if self._fill_pool is not None:
            self._fill_pool.shutdown(wait=False)
