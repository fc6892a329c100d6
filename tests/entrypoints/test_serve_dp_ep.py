"""`pagedllm serve -dp 2 --enable-expert-parallel` on loopback: the official openai client's concurrent requests,
served by both cores sharing the experts, get one process's greedy text; the server then stops cleanly (exit 0,
no core left)."""
from __future__ import annotations

import asyncio
import re
import shutil
from pathlib import Path

import httpx
import openai
import psutil
import pytest
from serve_helpers import Server

from pagedllm import LLM, SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
MODEL = "tiny-dp-ep"


def _make_moe_model(path: Path) -> str:
    """A tiny random Qwen3-MoE (16 experts) sized to the real Mistral tokenizer, whose files it carries."""
    from assets import tokenizer_dir
    from tiny_models import make_tiny_model
    from transformers import AutoTokenizer

    tdir = tokenizer_dir("mistral")
    tok = AutoTokenizer.from_pretrained(tdir)
    make_tiny_model("qwen3_moe", path, vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                    eos_token_id=tok.eos_token_id, pad_token_id=None)
    for f in tdir.iterdir():
        shutil.copy(f, path)
    return str(path)


def test_dp2_ep_serves_one_process_text_with_both_cores(tmp_path: Path):
    model = _make_moe_model(tmp_path / "model")
    prompts = [f"{i} " * (3 + 2 * i) for i in range(6)]
    llm = LLM(model=model, dtype="float32", device="cpu", max_model_len=256)
    try:
        want = [o.outputs[0].text for o in llm.generate(
            prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)]
    finally:
        llm.llm_engine.shutdown()

    server = Server("dp-ep", model, ["-dp", "2", "--enable-expert-parallel", "--served-model-name", MODEL], tmp_path)
    try:
        server.wait_ready()
        cores = [p for p in server.children() if "spawn_main" in " ".join(psutil.Process(p).cmdline())
                 and "resource_tracker" not in " ".join(psutil.Process(p).cmdline())]
        assert len(cores) == 2, cores
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)

        async def main():
            return await asyncio.gather(*[
                client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0,
                                          extra_body={"ignore_eos": True})
                for p in prompts
            ])

        outs = asyncio.run(main())
        assert [o.choices[0].text for o in outs] == want
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
        found = re.findall(rf'pagedllm:generation_tokens_total\{{engine="(\d+)",model_name="{MODEL}"\}} ([0-9.e+]+)',
                           metrics)
        by_engine = {e: float(v) for e, v in found}
        assert set(by_engine) == {"0", "1"} and all(v > 0 for v in by_engine.values()), by_engine
        assert "this rank holds experts 0-7 of each (8 per rank, 2 expert-parallel ranks)" in server.log_tail(200000)
        assert "this rank holds experts 8-15 of each (8 per rank, 2 expert-parallel ranks)" in server.log_tail(200000)
    finally:
        server.stop()
    assert server.proc.returncode == 0, server.log_tail()
    assert not [p for p in cores if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
