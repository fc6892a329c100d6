"""`pagedllm serve` on the GPU end to end: a real server process answering concurrent streamed requests,
with asynchronous scheduling on and off, every stream whole and the server healthy afterwards.

Asynchronous scheduling launches each step's sampling apart from its forward pass, from the serving
loop; the logits buffer the runner keeps across steps must be written in the same inference mode there.
"""
from __future__ import annotations

import asyncio
import json
import os
import sys

import httpx
import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "entrypoints"))
from serve_helpers import Server  # noqa: E402
from tiny_models import make_tiny_model  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

NUM_REQUESTS = 48
CONCURRENCY = 24
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "llama")


async def _stream(client: httpx.AsyncClient, url: str, prompt: list[int]) -> tuple[int, str | None, list]:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    num_tokens, finish, errors = 0, None, []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                errors.append(event["error"])
                continue
            if event.get("usage"):
                num_tokens = event["usage"]["completion_tokens"]
            for choice in event["choices"]:
                finish = choice.get("finish_reason") or finish
    return num_tokens, finish, errors


async def _load(url: str) -> list:
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(4, 200, (NUM_REQUESTS,), generator=gen)
    prompts = [torch.randint(3, 380, (int(n),), generator=gen).tolist() for n in lengths]
    limit = asyncio.Semaphore(CONCURRENCY)
    async with httpx.AsyncClient(timeout=120) as client:
        async def one(p):
            async with limit:
                return await _stream(client, url, p)

        return await asyncio.gather(*(one(p) for p in prompts))


@pytest.mark.parametrize("async_scheduling", ["--async-scheduling", "--no-async-scheduling"])
def test_concurrent_streams_complete(tiny_path, tmp_path, async_scheduling):
    server = Server(
        "gpu", tiny_path,
        ["--device", "cuda", "--dtype", "bfloat16", "--skip-tokenizer-init", "--max-num-seqs", "16",
         async_scheduling],
        tmp_path,
    )
    try:
        server.wait_ready()
        # Twice: the first wave fills the runner's kept buffers, the second reuses them.
        for _ in range(2):
            results = asyncio.run(_load(server.url))
            for num_tokens, finish, errors in results:
                assert errors == [], server.log_tail()
                assert finish == "length" and num_tokens == MAX_TOKENS, server.log_tail()
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
        assert server.proc.poll() is None
    finally:
        server.stop()
