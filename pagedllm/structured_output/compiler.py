"""Compiles constraints against the model's vocabulary in a thread pool, with a bounded cache and deadline.

xgrammar releases the GIL while it compiles, so a pool thread runs beside the engine loop instead of
stalling it. A compile cannot be interrupted: one that passes its deadline fails the requests waiting
for it (and later ones with the same constraint, from the cache) while its thread runs on to the end;
the size bound on constraints (grammar.MAX_CONSTRAINT_CHARS) keeps that rare and finite.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import xgrammar as xgr

from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured_output.grammar import build_grammar, clean_error

logger = logging.getLogger("pagedllm")

# Compiled grammars kept for reuse (least recently used dropped first). One for a JSON schema over a
# 150k-token vocabulary holds a few hundred KiB of token-mask cache.
DEFAULT_CACHE_ENTRIES = 256
# And bounded in bytes: a complex schema over a large vocabulary can take megabytes.
DEFAULT_CACHE_BYTES = 512 << 20
# Seconds a request may wait for its grammar before it fails.
DEFAULT_COMPILE_TIMEOUT_S = 20.0


class CompileError(Exception):
    """A constraint that could not be compiled; the message is meant for the client."""


class GrammarCompiler:
    """Constraint -> Future[xgr.CompiledGrammar], one compile per distinct constraint while cached."""

    def __init__(
        self,
        tokenizer_loader: Callable[[], Any],
        vocab_size: int,
        max_threads: int = 2,
        cache_entries: int = DEFAULT_CACHE_ENTRIES,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
    ) -> None:
        self._tokenizer_loader = tokenizer_loader
        self.vocab_size = vocab_size
        self.cache_entries = cache_entries
        self.cache_bytes = cache_bytes
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(max_workers=max_threads, thread_name_prefix="pagedllm-grammar")
        self._cache: OrderedDict[str, Future] = OrderedDict()
        # When each uncompleted future started; a compile past its deadline is marked failed here.
        self._started: dict[str, float] = {}
        self._lock = threading.Lock()
        # Its own lock: the engine core's expire/lookup must not wait while a pool thread loads the tokenizer.
        self._init_lock = threading.Lock()
        self._xgr_compiler: xgr.GrammarCompiler | None = None
        self._info: xgr.TokenizerInfo | None = None
        self.num_compiles = 0
        self.num_hits = 0

    def _compiler(self) -> xgr.GrammarCompiler:
        # Built on the first constrained request, in a pool thread: loading the tokenizer and reading its
        # vocabulary takes about a second, which engines that never see a constraint do not pay.
        with self._init_lock:
            if self._xgr_compiler is None:
                tokenizer = self._tokenizer_loader()
                if tokenizer is None:
                    raise CompileError("structured outputs need the model's tokenizer (skip_tokenizer_init is set)")
                # The logits may be wider than the tokenizer's vocabulary (padded embeddings): the extra
                # ids are never allowed.
                self._info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size)
                # Our cache is the only one, bounded in entries.
                self._xgr_compiler = xgr.GrammarCompiler(self._info, max_threads=1, cache_enabled=False)
            return self._xgr_compiler

    def _compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        compiler = self._compiler()
        try:
            grammar = build_grammar(params)
        except ValueError as e:
            raise CompileError(str(e)) from None
        try:
            return compiler.compile_grammar(grammar)
        except Exception as e:  # noqa: BLE001 - whatever xgrammar raises, the constraint is at fault
            raise CompileError(f"structured_outputs.{params.kind} could not be compiled: {clean_error(e)}") from None

    def submit(self, params: StructuredOutputsParams) -> tuple[str, Future]:
        """The future of the constraint's compiled grammar (a cached one when there is one)."""
        key = params.cache_key()
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
                self.num_hits += 1
                return key, fut
            self.num_compiles += 1
            fut = self._pool.submit(self._compile, params)
            self._cache[key] = fut
            self._started[key] = time.monotonic()
            # The newest entry (still compiling) stays; requests already waiting keep their own futures.
            while len(self._cache) > 1 and (
                len(self._cache) > self.cache_entries or self._cached_bytes() > self.cache_bytes
            ):
                old, _ = self._cache.popitem(last=False)
                self._started.pop(old, None)
        fut.add_done_callback(lambda _f, k=key: self._started.pop(k, None))
        return key, fut

    def _cached_bytes(self) -> int:
        total = 0
        for fut in self._cache.values():
            if fut.done() and fut.exception() is None:
                total += fut.result().memory_size_bytes
        return total

    def expire(self, now: float | None = None) -> None:
        """Fails the futures of compiles past their deadline; their threads finish unobserved."""
        now = time.monotonic() if now is None else now
        with self._lock:
            late = [k for k, t0 in self._started.items() if now - t0 > self.timeout_s]
            for key in late:
                del self._started[key]
                fut = self._cache.get(key)
                if fut is None:
                    continue
                # A replacement future, failed at once, takes the late one's place in the cache so that
                # later requests for the same constraint fail fast too.
                failed: Future = Future()
                failed.set_exception(CompileError(
                    f"compiling the structured_outputs constraint took longer than {self.timeout_s:g} s; "
                    "simplify the schema, regex or grammar"
                ))
                self._cache[key] = failed

    def lookup(self, key: str) -> Future | None:
        with self._lock:
            return self._cache.get(key)

    @property
    def tokenizer_info(self) -> xgr.TokenizerInfo:
        self._compiler()
        assert self._info is not None
        return self._info

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
