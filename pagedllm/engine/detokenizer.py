"""Incremental detokenization of one sequence, with stop strings and stream-safe text deltas.

Each new token is decoded inside a small sliding window of earlier tokens (the prefix/read offset
scheme), so the text produced equals decoding the whole output at once while each step costs only a
few short decode calls. The window is what makes tokenizer quirks come out right:
- SentencePiece word-start markers: a window that starts a few tokens back keeps the space that a
  lone decode would strip from the first generated word;
- multi-byte UTF-8 split over byte tokens: while the window ends in an incomplete sequence (U+FFFD
  at the end) nothing is emitted, and the whole character appears once its last byte arrives.
"""
from __future__ import annotations

from collections.abc import Iterable, Set

from pagedllm.sampling_params import SamplingParams

# Prompt tokens kept as left context for the first generated token.
_PROMPT_CONTEXT = 5
# How far the context may reach further back to avoid starting inside a multi-byte character
# (a UTF-8 character is at most 4 bytes, i.e. at most 4 byte tokens).
_MAX_CONTEXT_SHIFT = 4
# Drop consumed ids from the front of the window buffer once this many have piled up.
_COMPACT_AFTER = 64
_REPLACEMENT = "\ufffd"


def special_token_ids(tokenizer) -> frozenset[int]:
    """Ids that decode(..., skip_special_tokens=True) drops. Compute once per tokenizer and pass to
    IncrementalDetokenizer to save the scan per request."""
    ids: set[int] = set()
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids.update(i for i, tok in added.items() if getattr(tok, "special", False))
    # A tokenizers-backed tokenizer skips exactly its backend's special added tokens; a pure-Python
    # one skips its all_special_ids.
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        ids.update(getattr(tokenizer, "all_special_ids", None) or ())
    return frozenset(ids)


def _rust_backend(tokenizer):
    """The tokenizers.Tokenizer behind a fast tokenizer whose decode adds nothing on top of it, else
    None. Calling it directly skips transformers' per-call overhead (a few microseconds per token,
    which adds up over a large batch); with cleanup disabled the result is the same text."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend as fast_base
    except ImportError:  # transformers < 5
        from transformers import PreTrainedTokenizerFast as fast_base
    return backend if getattr(type(tokenizer), "_decode", None) is fast_base._decode else None


class IncrementalDetokenizer:
    """Text of one generated sequence, kept up to date token by token.

    Not thread-safe; one instance per sequence. With params.detokenize False it only counts tokens.
    """

    def __init__(
        self,
        tokenizer,
        prompt_token_ids: list[int],
        params: SamplingParams,
        special_ids: Set[int] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.output_text = ""
        self.num_output_tokens = 0
        self._detokenize = params.detokenize
        self._skip_special = params.skip_special_tokens
        self._spaces_between_special = params.spaces_between_special_tokens
        self._min_tokens = params.min_tokens
        self._include_stop = params.include_stop_str_in_output
        self._stop = list(params.stop or []) if params.detokenize else []
        # Streaming holds back this many trailing chars, which might be the start of a stop string
        # that would later be cut away. Kept stop strings never need hiding.
        self._stop_holdback = (
            max(len(s) for s in self._stop) - 1 if self._stop and not self._include_stop else 0
        )
        self._streamed = 0  # chars of output_text already returned as deltas
        self._anchor: tuple[list[int], str] | None = None  # context for decode_token, made lazily
        self._backend = _rust_backend(tokenizer)
        if not self._detokenize:
            return
        if self._skip_special:
            self._special = special_ids if special_ids is not None else special_token_ids(tokenizer)
        else:
            self._special = frozenset()
        self._init_window(prompt_token_ids)

    # ----- window decoding -----

    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=self._skip_special)
        return self.tokenizer.decode(
            ids,
            skip_special_tokens=self._skip_special,
            spaces_between_special_tokens=self._spaces_between_special,
            clean_up_tokenization_spaces=False,
        )

    def _init_window(self, prompt_token_ids: list[int]) -> None:
        # Skipped special tokens never enter the window: a window starting on one would make a
        # SentencePiece decoder strip the following word's space, which a full decode keeps.
        wanted = _PROMPT_CONTEXT + _MAX_CONTEXT_SHIFT
        context: list[int] = []
        for t in reversed(prompt_token_ids):
            if t not in self._special:
                context.append(t)
                if len(context) == wanted:
                    break
        context.reverse()
        self._ids: list[int] = context
        self._read = len(self._ids)
        prefix = max(0, self._read - _PROMPT_CONTEXT)
        # Reach back while the context would begin mid-character (decodes to U+FFFD first).
        while prefix > 0 and self._decode(self._ids[prefix : self._read]).startswith(_REPLACEMENT):
            prefix -= 1
        self._prefix = prefix
        # A prompt that ends inside a character: its pending bytes complete in the output, so the
        # prefix text must not count their placeholder.
        self._prefix_text = self._decode(self._ids[prefix : self._read]).rstrip(_REPLACEMENT)

    def _step(self) -> str:
        """Text that the ids appended since the last emission add; '' while it is incomplete."""
        text = self._decode(self._ids[self._prefix :])
        if len(text) <= len(self._prefix_text) or text.endswith(_REPLACEMENT):
            return ""
        new_text = text[len(self._prefix_text) :]
        # The ids just decoded become the next window's context.
        self._prefix, self._read = self._read, len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix : self._read])
        if self._prefix > _COMPACT_AFTER:
            del self._ids[: self._prefix]
            self._read -= self._prefix
            self._prefix = 0
        return new_text

    # ----- public API -----

    def update(self, new_token_ids: Iterable[int]) -> str | None:
        """Appends tokens and extends output_text. Returns the stop string that matched (output_text
        is then truncated before it, or after it with include_stop_str_in_output), else None."""
        new_token_ids = list(new_token_ids)
        self.num_output_tokens += len(new_token_ids)
        if not self._detokenize:
            return None
        pieces = []
        for token_id in new_token_ids:
            if token_id in self._special:
                continue
            self._ids.append(token_id)
            pieces.append(self._step())
        if not pieces:
            return None
        checked = len(self.output_text)
        self.output_text += "".join(pieces)
        # Same threshold as stop tokens, which are masked while fewer than min_tokens exist.
        if self._stop and self.num_output_tokens > self._min_tokens:
            return self._check_stop(checked)
        return None

    def _check_stop(self, checked: int) -> str | None:
        """Finds the earliest stop string ending in the text after `checked` and truncates there."""
        text = self.output_text
        best: tuple[int, int, str] | None = None  # (start, -len, stop) : earliest, then longest
        for stop in self._stop:
            # A match may begin up to len(stop) - 1 chars before the new text.
            start = text.find(stop, max(0, checked - len(stop) + 1))
            if start != -1 and (best is None or (start, -len(stop)) < best[:2]):
                best = (start, -len(stop), stop)
        if best is None:
            return None
        start, _, stop = best
        self.output_text = text[: start + len(stop)] if self._include_stop else text[:start]
        return stop

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The full text (delta False) or the text not returned before (delta True). Until finished,
        the last len(longest stop) - 1 chars are withheld: they may yet turn into a stop string."""
        end = len(self.output_text) if finished else max(0, len(self.output_text) - self._stop_holdback)
        if not delta:
            return self.output_text[:end]
        if end <= self._streamed:
            return ""
        piece = self.output_text[self._streamed : end]
        self._streamed = end
        return piece

    def decode_token(self, token_id: int) -> str:
        """Text of one token alone, for Logprob.decoded_token. Decoded after a fixed one-char anchor
        so that SentencePiece word-start tokens keep their leading space (" Paris", not "Paris")."""
        if self._anchor is None:
            ids = self.tokenizer.encode("a", add_special_tokens=False)
            self._anchor = (ids, self._decode_plain(ids))
        ids, anchor_text = self._anchor
        text = self._decode_plain(ids + [token_id])
        if anchor_text and text.startswith(anchor_text):
            return text[len(anchor_text) :]
        return self._decode_plain([token_id])

    def _decode_plain(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids, skip_special_tokens=False, spaces_between_special_tokens=False,
            clean_up_tokenization_spaces=False,
        )
