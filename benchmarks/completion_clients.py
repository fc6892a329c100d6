"""Greedy completions of an exact length from an OpenAI-compatible server (pagedllm or llama-server): one
streamed at a time (time to the first token, decode rate) and many at a time (total output tokens/s). Not run
by itself (``cpu_vs_llama_cpp.py`` uses it)."""
from __future__ import annotations

import asyncio
import json
import time

class Target:
    """How to ask one server for a greedy completion of exactly `max_tokens` tokens with EOS ignored."""

    def __init__(self, name: str, url: str, model: str, extra: dict) -> None:
        self.name, self.url, self.model, self.extra = name, url, model, extra

    def body(self, prompt: str, max_tokens: int, stream: bool) -> dict:
        b = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
             "ignore_eos": True, "stream": stream, **self.extra}
        if self.name == "llama.cpp":
            b["n_predict"] = max_tokens
        if stream:
            b["stream_options"] = {"include_usage": True}
        return b


def streamed(client, target: Target, prompt: str, max_tokens: int) -> dict:
    """One streamed completion: send time, first event with a choice, end, and the usage's token counts."""
    t0 = time.perf_counter()
    t_first = None
    usage = None
    text = []
    with client.stream("POST", target.url + "/v1/completions", json=target.body(prompt, max_tokens, True)) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"{target.name} answered {r.status_code}: {r.text[:500]}")
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            if event.get("choices"):
                if t_first is None:
                    t_first = time.perf_counter()
                text.append(event["choices"][0].get("text") or "")
            if event.get("usage"):
                usage = event["usage"]
    t_end = time.perf_counter()
    if usage is None:
        raise RuntimeError(f"{target.name} sent no usage in a stream that asked for it (stream_options.include_usage)")
    if t_first is None:
        raise RuntimeError(f"{target.name} streamed no choice")
    return {"ttft_s": t_first - t0, "total_s": t_end - t0, "decode_s": t_end - t_first,
            "prompt_tokens": usage["prompt_tokens"], "completion_tokens": usage["completion_tokens"],
            "text": "".join(text)}


async def concurrent_run(target: Target, prompts: list[str], max_tokens: int, concurrency: int) -> dict:
    import httpx

    sem = asyncio.Semaphore(concurrency)
    results: list[dict | None] = [None] * len(prompts)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0), limits=limits) as client:
        async def one(i: int, prompt: str) -> None:
            async with sem:
                t0 = time.perf_counter()
                r = await client.post(target.url + "/v1/completions", json=target.body(prompt, max_tokens, False))
                if r.status_code != 200:
                    raise RuntimeError(f"{target.name} answered {r.status_code}: {r.text[:500]}")
                out = r.json()
                results[i] = {"latency_s": time.perf_counter() - t0, "text": out["choices"][0]["text"],
                              "prompt_tokens": out["usage"]["prompt_tokens"],
                              "completion_tokens": out["usage"]["completion_tokens"]}

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        wall = time.perf_counter() - t0
    done = [r for r in results if r is not None]
    tokens = sum(r["completion_tokens"] for r in done)
    return {"wall_s": wall, "output_tokens": tokens, "tok_s": tokens / wall,
            "prompt_tokens": sum(r["prompt_tokens"] for r in done), "requests": done}


def model_id(url: str) -> str:
    import httpx

    data = httpx.get(url + "/v1/models", timeout=10).json().get("data") or []
    return data[0]["id"] if data else "default"
