"""The LLM API end to end with a real tokenizer: text, stop strings, n > 1, seeds, logprobs, chat, errors."""
from __future__ import annotations

import pytest
import torch
from tiny_models import make_tiny_model_with_tokenizer

from pagedllm import LLM, SamplingParams


@pytest.fixture(scope="module")
def mistral_llm(tmp_path_factory):
    path = make_tiny_model_with_tokenizer("mistral", tmp_path_factory.mktemp("mistral-tok"))
    return LLM(model=path, dtype="float32", device="cpu", kv_cache_memory_bytes=1 << 25, max_model_len=256)


def _pool(llm):
    return llm.llm_engine.engine_core.scheduler.kv_cache_manager.block_pool


def test_text_matches_token_ids(mistral_llm):
    tok = mistral_llm.get_tokenizer()
    outs = mistral_llm.generate(
        ["Hello, my name is", "The capital of France is"],
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
        use_tqdm=False,
    )
    for o in outs:
        c = o.outputs[0]
        assert len(c.token_ids) == 20 and c.finish_reason == "length"
        assert o.prompt_token_ids == tok.encode(o.prompt)
        full = tok.decode(o.prompt_token_ids + c.token_ids, skip_special_tokens=True)
        prefix = tok.decode(o.prompt_token_ids, skip_special_tokens=True)
        assert prefix + c.text == full


def test_stop_string_trimmed_and_kept(mistral_llm):
    base = mistral_llm.generate(
        "Once upon a time", SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    # Stop on a piece of text the model really produces, taken from the middle of its output.
    stop = base.text[len(base.text) // 2 : len(base.text) // 2 + 3]
    assert stop.strip()
    cut = base.text.index(stop)
    out = mistral_llm.generate(
        "Once upon a time", SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop]),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.text == base.text[:cut] and out.finish_reason == "stop" and out.stop_reason == stop
    kept = mistral_llm.generate(
        "Once upon a time",
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop], include_stop_str_in_output=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert kept.text == base.text[: cut + len(stop)]
    assert _pool(mistral_llm).get_num_free_blocks() == _pool(mistral_llm).num_blocks


def test_n_seeds_and_shared_prompt_blocks(mistral_llm):
    prompt = "A long shared prompt that the children share " * 8
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    a = mistral_llm.generate(prompt, params, use_tqdm=False)[0]
    assert [c.index for c in a.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1, "children of one seeded request must differ"
    b = mistral_llm.generate([prompt, "something else entirely"], [params, SamplingParams(seed=1)], use_tqdm=False)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs], "seeded output depends on batch"
    # Siblings share the prompt's full blocks: started in the same step, later ones hit the first's.
    engine = mistral_llm.llm_engine
    engine.add_request("share", prompt, SamplingParams(n=3, max_tokens=4, ignore_eos=True))
    engine.step()
    kv = engine.engine_core.scheduler.kv_cache_manager
    tables = [kv.get_block_ids(cid) for cid in engine.output_processor.states["share"].children]
    num_full = len(engine.processor.tokenize_prompt(prompt)[1]) // kv.block_size
    assert num_full >= 2
    assert tables[0][:num_full] == tables[1][:num_full] == tables[2][:num_full]
    assert all(kv.block_pool.blocks[b].ref_cnt == 3 for b in tables[0][:num_full])
    while engine.has_unfinished_requests():
        engine.step()
    assert kv.block_pool.get_num_free_blocks() == kv.block_pool.num_blocks


def test_logprobs_and_prompt_logprobs_match_model(mistral_llm):
    from transformers import AutoModelForCausalLM

    path = mistral_llm.llm_engine.config.model_config.model
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = mistral_llm.generate(
        "Paged attention keeps",
        SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3, prompt_logprobs=2),
        use_tqdm=False,
    )[0]
    ids = out.prompt_token_ids + out.outputs[0].token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(out.prompt_token_ids)
    for pos in range(1, len(out.prompt_token_ids)):
        d, tok = out.prompt_logprobs[pos], ids[pos]
        assert abs(d[tok].logprob - ref[pos - 1, tok].item()) < 1e-4
        assert d[tok].rank == int((ref[pos - 1] > ref[pos - 1, tok]).sum()) + 1
        assert len(d) in (2, 3)
    c = out.outputs[0]
    total = 0.0
    for j, tok in enumerate(c.token_ids):
        row = ref[len(out.prompt_token_ids) - 1 + j]
        assert abs(c.logprobs[j][tok].logprob - row[tok].item()) < 1e-4 and c.logprobs[j][tok].rank == 1
        assert set(c.logprobs[j]) == set(torch.topk(row, 3).indices.tolist())
        total += c.logprobs[j][tok].logprob
    assert abs(c.cumulative_logprob - total) < 1e-4


def test_bad_prompts_raise_and_leave_engine_clean(mistral_llm):
    with pytest.raises(ValueError, match=r"the prompt has 300 tokens, but max_model_len is 256"):
        mistral_llm.generate([{"prompt_token_ids": [5] * 10}, {"prompt_token_ids": [5] * 300}], use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompt is empty"):
        mistral_llm.generate({"prompt_token_ids": []}, use_tqdm=False)
    with pytest.raises(ValueError, match=r"token id 99999, outside the vocabulary \[0, 32000\)"):
        mistral_llm.generate({"prompt_token_ids": [1, 99999]}, use_tqdm=False)
    with pytest.raises(ValueError, match=r"sampling_params has 2 entries but there are 1 prompts"):
        mistral_llm.generate(["a"], [SamplingParams(), SamplingParams()], use_tqdm=False)
    assert not mistral_llm.llm_engine.has_unfinished_requests()
    assert _pool(mistral_llm).get_num_free_blocks() == _pool(mistral_llm).num_blocks
    out = mistral_llm.generate("still works", SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_abort_frees_blocks(mistral_llm):
    engine = mistral_llm.llm_engine
    engine.add_request("keep", "first request", SamplingParams(max_tokens=6, ignore_eos=True))
    engine.add_request("drop", "second request", SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.abort_request(["drop"])
    finished = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            finished[o.request_id] = o
    assert set(finished) == {"keep"} and len(finished["keep"].outputs[0].token_ids) == 6
    pool = _pool(mistral_llm)
    assert pool.get_num_free_blocks() == pool.num_blocks


def test_chat_renders_like_apply_chat_template(tmp_path):
    path = make_tiny_model_with_tokenizer("qwen3", tmp_path)
    llm = LLM(model=path, dtype="float32", device="cpu", kv_cache_memory_bytes=1 << 24, max_model_len=256)
    tok = llm.get_tokenizer()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there! 你好"}]
    expected = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    out = llm.chat(messages, SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)[0]
    assert tok.decode(out.prompt_token_ids) == expected
    assert out.prompt_token_ids == tok.encode(expected, add_special_tokens=False)
