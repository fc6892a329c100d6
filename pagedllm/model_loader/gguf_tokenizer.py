"""Builds the transformers tokenizer a GGUF file's metadata describes, and caches it on disk.

Gemma 3 files hold a SentencePiece BPE vocabulary without merges. Transformers turns that into the
right tokenizer only in recent versions (5.17 builds a Unigram model, which segments differently and
adds no BOS), so for Gemma 3 the tokenizer is built here with the ``tokenizers`` library, equal to
Google's own ``tokenizer.json`` in vocabulary, merges and pipeline. Other vocabularies (Llama
SentencePiece, GPT-2 byte-level BPE of Qwen and Llama 3) go through ``AutoTokenizer(gguf_file=)``.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from pagedllm.model_loader.gguf_reader import open_gguf

logger = logging.getLogger(__name__)

_CACHE_FORMAT = "1"  # bump when the built tokenizer changes, to retire older cache entries
# llama.cpp token types (gguf.TokenType)
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4
_SPACE_MARK = "\u2581"  # SentencePiece's visible space


def _strings(reader: Any, key: str) -> list[str]:
    field = reader.fields[key]
    return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]


def _ints(reader: Any, key: str) -> list[int]:
    field = reader.fields.get(key)
    return [] if field is None else [int(field.parts[i][0]) for i in field.data]


def _scalar(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _sentencepiece_merges(tokens: list[str], types: list[int]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every split of a token into two tokens.

    SentencePiece ranks a merge by its result's score. User-defined pieces scored highest, so
    their merges go first, longer left part first; the learned pieces follow in file order (their
    rank), longer left part first. This reproduces Gemma 3's tokenizer.json merge list exactly.
    """
    ids = {t: i for i, t in enumerate(tokens)}
    learned, user = [], []
    for merged, i in ids.items():
        is_learned = types[i] == _NORMAL if types else True
        n = len(merged)
        for cut in range(n - 1, 0, -1):  # longer left part first
            left = merged[:cut]
            if left in ids:
                right = merged[cut:]
                if right in ids:
                    if is_learned:
                        learned.append((i, left, right))
                    else:
                        user.append(((-cut, cut - n, i), left, right))
    # Sorting on the id alone (stable) keeps each token's cuts in the order walked: a third faster than
    # sorting every merge on a tuple.
    user.sort(key=lambda r: r[0])
    learned.sort(key=lambda r: r[0])
    return [(left, right) for _, left, right in user] + [(left, right) for _, left, right in learned]


def _gemma_tokenizer(reader: Any) -> Any:
    """Gemma's SentencePiece BPE as a fast tokenizer: byte fallback, spaces as U+2581, BOS prepended."""
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    tokens = _strings(reader, "tokenizer.ggml.tokens")
    types = _ints(reader, "tokenizer.ggml.token_type")
    # Runs of spaces are stored as spaces; the model matches them as U+2581 runs (what the normalizer makes).
    tokens = [_SPACE_MARK * len(t) if t and set(t) == {" "} else t for t in tokens]

    def name(key: str) -> str | None:
        token_id = _scalar(reader, f"tokenizer.ggml.{key}")
        return None if token_id is None else tokens[int(token_id)]

    bos, eos, unk, pad = name("bos_token_id"), name("eos_token_id"), name("unknown_token_id"), name("padding_token_id")
    vocab = {t: i for i, t in enumerate(tokens)}
    backend = Tokenizer(
        BPE(vocab, _sentencepiece_merges(tokens, types), unk_token=unk, fuse_unk=True, byte_fallback=True)
    )
    steps = [normalizers.Prepend(_SPACE_MARK)] if _scalar(reader, "tokenizer.ggml.add_space_prefix", False) else []
    backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", _SPACE_MARK)])
    backend.pre_tokenizer = pre_tokenizers.Split(" ", "merged_with_previous")
    backend.decoder = decoders.Sequence(
        [decoders.Replace(_SPACE_MARK, " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    # Control tokens (<bos>, <start_of_turn>, <unusedN>, ...) are special; user-defined ones (newline
    # runs, <table>, ...) are matched whole but are text. Both are matched in the raw input.
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == _CONTROL]
    )
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == _USER_DEFINED])

    add_bos = bool(_scalar(reader, "tokenizer.ggml.add_bos_token", True)) and bos is not None
    add_eos = bool(_scalar(reader, "tokenizer.ggml.add_eos_token", False)) and eos is not None
    wrap = ([bos] if add_bos else []), ([eos] if add_eos else [])
    single = [*wrap[0], "$A", *wrap[1]]
    pair = single + [f"{t}:1" for t in wrap[0]] + ["$B:1"] + [f"{t}:1" for t in wrap[1]]
    specials = [(t, vocab[t]) for t in {*wrap[0], *wrap[1]}]
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)

    # Gemma names <mask> in its tokenizer config; the GGUF has no key for it.
    mask = "<mask>" if "<mask>" in vocab else None
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=bos, eos_token=eos, unk_token=unk, pad_token=pad, mask_token=mask,
        clean_up_tokenization_spaces=False,
    )
    template = _scalar(reader, "tokenizer.chat_template")
    if template:
        tokenizer.chat_template = template
    return tokenizer


def build_gguf_tokenizer(path: str | os.PathLike, reader: Any = None) -> Any:
    """The tokenizer of a GGUF file, built from its metadata (no cache)."""
    path = os.path.abspath(os.fspath(path))
    reader = reader if reader is not None else open_gguf(path)
    arch = _scalar(reader, "general.architecture")
    if arch == "gemma3" and _scalar(reader, "tokenizer.ggml.model") == "llama" and "tokenizer.ggml.merges" not in reader.fields:
        return _gemma_tokenizer(reader)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def tokenizer_cache_key(path: str | os.PathLike) -> str:
    """Names a cache entry: changes with the file (path, size, mtime) and with the libraries that build it."""
    import tokenizers
    import transformers

    path = os.path.realpath(os.fspath(path))
    st = os.stat(path)
    ident = [path, str(st.st_size), str(st.st_mtime_ns), transformers.__version__, tokenizers.__version__, _CACHE_FORMAT]
    return hashlib.sha256("\0".join(ident).encode()).hexdigest()[:24]


def _store(tokenizer: Any, entry: Path) -> None:
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        staging = tempfile.mkdtemp(prefix=".partial-", dir=entry.parent)
        tokenizer.save_pretrained(staging)
        # Renamed as a whole so a concurrent reader never sees half an entry; a racing writer's wins.
        try:
            os.rename(staging, entry)
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
    except OSError as e:  # a read-only cache must not stop the engine
        logger.warning("could not cache the tokenizer at %s: %s", entry, e)


def _load_entry(entry: Path) -> Any:
    """A cached tokenizer. transformers' from_pretrained also parses the 33 MB tokenizer.json in Python
    when the config lists no added tokens (~1.2 s of a ~2.4 s load); the entries written here hold
    only that file and the config, so the fast tokenizer is built from them directly."""
    from transformers import PreTrainedTokenizerFast

    config = json.loads((entry / "tokenizer_config.json").read_text(encoding="utf-8"))
    files = {p.name for p in entry.iterdir()}
    if files != {"tokenizer.json", "tokenizer_config.json"} or "added_tokens_decoder" in config:
        return PreTrainedTokenizerFast.from_pretrained(str(entry))
    kwargs = {k: v for k, v in config.items() if k not in ("backend", "tokenizer_class")}
    return PreTrainedTokenizerFast(tokenizer_file=str(entry / "tokenizer.json"), name_or_path=str(entry), **kwargs)


def gguf_tokenizer(path: str | os.PathLike, cache: bool = True) -> Any:
    """The transformers tokenizer for a GGUF file.

    Gemma 3's is built here (see the module doc) and, with ``cache``, saved once under
    ``cache_dir()/tokenizers``: building decodes a 262k-token vocabulary and derives 515k merges
    (~10 s), loading the saved ``tokenizer.json`` takes ~3 s. Other files get transformers' tokenizer.
    """
    from transformers import PreTrainedTokenizerFast

    from pagedllm.model_loader.default_model import cache_dir

    path = os.path.abspath(os.fspath(path))
    entry = cache_dir() / "tokenizers" / tokenizer_cache_key(path) if cache else None
    if entry is not None and (entry / "tokenizer.json").is_file():
        try:
            return _load_entry(entry)
        except Exception:  # a damaged cache entry: rebuild it below
            logger.warning("rebuilding the cached tokenizer of %s at %s", path, entry)
            shutil.rmtree(entry, ignore_errors=True)
    tokenizer = build_gguf_tokenizer(path)
    # Only tokenizers built here are cached: a generic fast tokenizer reloads exactly, while
    # transformers' model-specific classes may rebuild their pipeline on load.
    if entry is not None and type(tokenizer) is PreTrainedTokenizerFast:
        _store(tokenizer, entry)
    return tokenizer
