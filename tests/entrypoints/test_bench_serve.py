"""`pagedllm bench serve`: arrival processes, datasets, the summary maths, and a short run against a real server."""
from __future__ import annotations

import asyncio
import json
import random
import statistics

import httpx
import pytest

from pagedllm.entrypoints.bench import serve as bench


def test_arrivals_poisson_gamma_and_burst():
    rng = random.Random(0)
    poisson = bench.arrival_delays(4000, 10.0, 1.0, rng)
    bursty = bench.arrival_delays(4000, 10.0, 0.25, rng)
    assert statistics.fmean(poisson) == pytest.approx(0.1, rel=0.08)
    assert statistics.fmean(bursty) == pytest.approx(0.1, rel=0.15)
    # Coefficient of variation: 1 for Poisson, 1/sqrt(k) = 2 for gamma shape 0.25.
    assert statistics.pstdev(poisson) / statistics.fmean(poisson) == pytest.approx(1.0, rel=0.1)
    assert statistics.pstdev(bursty) / statistics.fmean(bursty) == pytest.approx(2.0, rel=0.15)
    assert bench.arrival_delays(5, float("inf"), 1.0, rng) == [0.0] * 5
    with pytest.raises(ValueError):
        bench.arrival_delays(5, 1.0, 0.0, rng)


def test_datasets_and_goodput_parsing():
    fixed = bench.make_prompts("random", 20, 30, 7, 0.0, 0)
    assert all(len(p.prompt.split()) == 30 and p.output_len == 7 for p in fixed)
    varied = bench.make_prompts("random", 200, 30, 10, 0.5, 0)
    assert min(len(p.prompt.split()) for p in varied) >= 15 and max(len(p.prompt.split()) for p in varied) <= 45
    share = bench.make_prompts("sharegpt-like", 2000, 100, 50, 0.0, 0)
    lens = [len(p.prompt.split()) for p in share]
    assert statistics.fmean(lens) == pytest.approx(100, rel=0.15) and max(lens) > 3 * statistics.median(lens)
    assert bench.parse_goodput(["ttft:500", "tpot:50"]) == {"ttft": 500.0, "tpot": 50.0}
    with pytest.raises(ValueError):
        bench.parse_goodput(["latency:5"])


def test_summary_maths():
    results = [
        bench.RequestResult(ok=True, ttft=0.1, e2e=1.1, itl=[0.1] * 10, prompt_tokens=5, output_tokens=11),
        bench.RequestResult(ok=True, ttft=0.5, e2e=2.5, itl=[0.2] * 10, prompt_tokens=5, output_tokens=11),
        bench.RequestResult(ok=False, error="HTTP 500"),
    ]
    s = bench.summarize(results, 2.0, {"ttft": 200.0})
    assert (s["completed"], s["failed"], s["errors"]) == (2, 1, ["HTTP 500"])
    assert s["output_throughput"] == pytest.approx(11.0) and s["request_throughput"] == pytest.approx(1.0)
    assert s["ttft_ms"]["mean"] == pytest.approx(300.0) and s["ttft_ms"]["p99"] == pytest.approx(500.0)
    assert s["tpot_ms"]["median"] == pytest.approx(150.0)
    assert s["goodput"] == pytest.approx(0.5)  # only the first met ttft <= 200 ms


@pytest.mark.parametrize("http_client", ["aiohttp", "httpx"])
def test_bench_serve_against_a_server(completions_server, tmp_path, capsys, http_client):
    from pagedllm.entrypoints.cli.main import main

    out = tmp_path / "bench.json"
    argv = [
        "bench", "serve", "--base-url", completions_server.url, "--api-key", completions_server.api_key,
        "--num-prompts", "12", "--request-rate", "40", "--burstiness", "0.5", "--max-concurrency", "6",
        "--input-len", "12", "--output-len", "6", "--goodput", "ttft:60000", "tpot:60000",
        "--output-json", str(out), "--plot", str(tmp_path / "bench.png"), "--http-client", http_client,
    ]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert result["http_client"] == http_client
    assert result["completed"] == 12 and result["failed"] == 0
    assert result["total_output_tokens"] == 12 * 6
    assert result["goodput"] == pytest.approx(result["request_throughput"])
    assert result["ttft_ms"]["median"] > 0 and result["itl_ms"]["mean"] > 0
    printed = capsys.readouterr().out
    assert "Serving Benchmark Result" in printed and "TTFT" in printed
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


SEPARATORS = "a\u2028b\u2029c\x85d"  # raw in JSON; str.splitlines (and httpx's aiter_lines) splits on each


def test_stream_chunks_with_line_separators_survive_line_readers():
    from pagedllm.entrypoints.openai.protocol import CompletionChoice, CompletionStreamResponse
    from pagedllm.entrypoints.openai.serving_engine import sse_chunk

    event = sse_chunk(CompletionStreamResponse(id="x", model="m", choices=[CompletionChoice(index=0, text=SEPARATORS)]))
    assert event.endswith("\n\n") and len(event[:-2].splitlines()) == 1
    assert json.loads(event[len("data: "):])["choices"][0]["text"] == SEPARATORS


@pytest.mark.parametrize("http_client", ["aiohttp", "httpx"])
def test_bench_client_splits_events_on_newlines_only(http_client):
    raw = ('data: {"t": "' + SEPARATORS + '"}\n\ndata: [DONE]\n\n').encode()
    # Delivered in 3-byte pieces, so events and UTF-8 characters are cut across reads too.
    if http_client == "httpx":
        stream = bench._HttpxStream.__new__(bench._HttpxStream)
        stream.resp = httpx.Response(200, stream=httpx.ByteStream(b""), request=httpx.Request("POST", "http://x"))
        stream.resp.stream = _Pieces(raw, 3)
    else:
        stream = bench._AiohttpStream.__new__(bench._AiohttpStream)
        stream.resp = _AiohttpBody(_Pieces(raw, 3))

    async def lines():
        return [line async for line in stream.lines()]

    assert asyncio.run(lines()) == ['data: {"t": "' + SEPARATORS + '"}', "", "data: [DONE]", ""]


class _Pieces(httpx.AsyncByteStream):
    """A response body arriving in fixed-size pieces."""

    def __init__(self, data: bytes, size: int) -> None:
        self.data, self.size = data, size

    async def __aiter__(self):
        for i in range(0, len(self.data), self.size):
            yield self.data[i : i + self.size]

    def iter_any(self):
        return self.__aiter__()


class _AiohttpBody:
    """What the aiohttp reader uses of a response: ``content.iter_any()``."""

    def __init__(self, content: _Pieces) -> None:
        self.content = content
