"""`pagedllm bench serve`: load-test an OpenAI-compatible server with streaming completions.

Requests arrive as a Poisson process (burstiness 1) or a gamma process (burstiness < 1 is burstier,
> 1 more regular) at --request-rate, optionally capped at --max-concurrency in flight. Each request
streams; the client records time to first token (TTFT), the gaps between chunks (ITL), time per
output token after the first (TPOT) and end-to-end latency (E2E), and reports mean, median and p99,
throughput, and goodput (requests per second that met every --goodput SLO).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import time
from dataclasses import dataclass, field

# Short, common words: most are one token in any English BPE / SentencePiece vocabulary, so a prompt
# of N words is close to N tokens (the exact count comes back in the usage of each response).
_WORDS = (
    "the of and to in is was he for it with as his on be at by had are but from or have an they which "
    "one you were all we her she there would their will when who him been has more if no out do so can "
    "what up said about other into than its time only could new them man some these then two first may "
    "any like now my such make over our even most me state after also made many did must before back see "
    "through way where get much go well your know should down work year because come people just say each "
    "those take day good how long left very same"
).split()


@dataclass
class BenchPrompt:
    prompt: str | list[int]  # text, or token ids (a /v1/completions token prompt)
    output_len: int


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    start: float = 0.0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", type=str, default="http://127.0.0.1:8000")
    parser.add_argument("--endpoint", type=str, default="/v1/completions")
    parser.add_argument("--model", type=str, default=None, help="model name (default: the server's first)")
    parser.add_argument("--api-key", type=str, default=None)
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s; inf sends all at once")
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of inter-arrival times (1 = Poisson)")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--dataset", choices=["random", "sharegpt-like"], default="random")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--random-range-ratio", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--goodput", type=str, nargs="+", default=None, metavar="KEY:MS",
                        help="SLOs in ms, e.g. ttft:500 tpot:50 e2el:5000")
    parser.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")
    parser.add_argument("--http-client", choices=["aiohttp", "httpx"], default=None,
                        help="client library (default: aiohttp when installed, else httpx)")
    parser.add_argument("--output-json", type=str, default=None)
    parser.add_argument("--plot", type=str, default=None, help="write a PNG of the latencies here (the bench extra)")


def make_prompts(dataset: str, n: int, input_len: int, output_len: int, range_ratio: float, seed: int) -> list[BenchPrompt]:
    if n < 1 or input_len < 1 or output_len < 1:
        raise ValueError("--num-prompts, --input-len and --output-len must be >= 1")
    rng = random.Random(seed)
    if dataset == "random":
        if not 0.0 <= range_ratio < 1.0:
            raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")

        def draw(mean: int) -> int:
            return rng.randint(max(1, int(mean * (1 - range_ratio))), max(1, int(mean * (1 + range_ratio))))

        lens = [(draw(input_len), draw(output_len)) for _ in range(n)]
    else:
        # Synthetic, ShareGPT-shaped: log-normal lengths (long right tail, a few very long turns)
        # scaled so that their means are about --input-len and --output-len.
        sigma_in, sigma_out = 1.0, 0.8
        lens = [
            (
                max(4, min(8 * input_len, int(rng.lognormvariate(math.log(input_len) - sigma_in**2 / 2, sigma_in)))),
                max(4, min(8 * output_len, int(rng.lognormvariate(math.log(output_len) - sigma_out**2 / 2, sigma_out)))),
            )
            for _ in range(n)
        ]
    return [BenchPrompt(" ".join(rng.choice(_WORDS) for _ in range(i)), o) for i, o in lens]


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    slos: dict[str, float] = {}
    for item in items or []:
        key, _, value = item.partition(":")
        if key not in ("ttft", "tpot", "e2el") or not value:
            raise ValueError(f"--goodput takes ttft:MS, tpot:MS or e2el:MS, got {item!r}")
        slos[key] = float(value)
    return slos


def arrival_delays(n: int, rate: float, burstiness: float, rng: random.Random) -> list[float]:
    if burstiness <= 0:
        raise ValueError(f"--burstiness must be > 0, got {burstiness}")
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0:
        raise ValueError(f"--request-rate must be > 0, got {rate}")
    # Gamma(shape k, scale 1/(rate k)) keeps the mean gap at 1/rate; k = 1 is exponential (Poisson).
    return [rng.gammavariate(burstiness, 1.0 / (rate * burstiness)) for _ in range(n)]


class _HttpxStream:
    """One streamed POST through httpx: status, body on error, and the response's lines."""

    def __init__(self, client, url: str, payload: dict, headers: dict, timeout: float) -> None:
        self._cm = client.stream("POST", url, json=payload, headers=headers, timeout=timeout)

    async def __aenter__(self):
        self.resp = await self._cm.__aenter__()
        self.status = self.resp.status_code
        return self

    async def __aexit__(self, *exc):
        return await self._cm.__aexit__(*exc)

    async def body(self) -> bytes:
        return await self.resp.aread()

    def _texts(self):
        return self.resp.aiter_text()

    async def lines(self):
        """The body's lines, split on LF only, as SSE defines them (httpx's aiter_lines also splits on
        U+2028 etc., which may stand raw inside an event's JSON)."""
        buf = ""
        async for text in self._texts():
            *done, buf = (buf + text).split("\n")
            for line in done:
                yield line.rstrip("\r")
        if buf:
            yield buf.rstrip("\r")


class _AiohttpStream(_HttpxStream):
    """The same through aiohttp, whose per-chunk overhead is lower (vLLM's serving benchmark uses it)."""

    def __init__(self, session, url: str, payload: dict, headers: dict, timeout: float) -> None:
        import aiohttp

        self._cm = session.post(url, json=payload, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout))

    async def __aenter__(self):
        self.resp = await self._cm.__aenter__()
        self.status = self.resp.status
        return self

    async def body(self) -> bytes:
        return await self.resp.read()

    async def _texts(self):
        import codecs

        decoder = codecs.getincrementaldecoder("utf-8")()
        async for data in self.resp.content.iter_any():
            yield decoder.decode(data)
        yield decoder.decode(b"", final=True)


def _client(backend: str, limit: int):
    """An async HTTP client holding up to ``limit`` kept-alive connections."""
    if backend == "aiohttp":
        import aiohttp

        return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=limit, limit_per_host=limit))
    if backend != "httpx":
        raise ValueError(f"--http-client must be aiohttp or httpx, got {backend!r}")
    import httpx

    return httpx.AsyncClient(limits=httpx.Limits(max_connections=limit, max_keepalive_connections=limit))


async def _get_json(backend: str, client, url: str, headers: dict) -> dict:
    if backend == "aiohttp":
        import aiohttp

        async with client.get(url, headers=headers, timeout=aiohttp.ClientTimeout(total=30)) as resp:
            status, body = resp.status, await resp.read()
    else:
        resp = await client.get(url, headers=headers, timeout=30)
        status, body = resp.status_code, resp.content
    if status != 200:
        raise RuntimeError(f"GET {url}: HTTP {status}: {body[:200]!r}")
    return json.loads(body)


def default_http_client() -> str:
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        return "httpx"
    return "aiohttp"


async def _one_request(stream_cls, client, url: str, payload: dict, headers: dict, timeout: float) -> RequestResult:
    res = RequestResult(start=time.perf_counter())
    last = res.start
    try:
        async with stream_cls(client, url, payload, headers, timeout) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.body())[:200]!r}"
                return res
            async for line in resp.lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = chunk["error"].get("message", "error")
                    return res
                if chunk.get("usage"):
                    res.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                choices = chunk.get("choices") or []
                if not any(c.get("text") or (c.get("delta") or {}).get("content") for c in choices):
                    continue
                now = time.perf_counter()
                if res.ttft == 0.0:
                    res.ttft = now - res.start
                else:
                    res.itl.append(now - last)
                last = now
        res.e2e = time.perf_counter() - res.start
        res.ok = True
    except Exception as e:  # noqa: BLE001 - any failure counts as a failed request
        res.error = f"{type(e).__name__}: {e}"
    return res


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0}
    s = sorted(values)
    p99 = s[min(len(s) - 1, max(0, math.ceil(0.99 * len(s)) - 1))]
    return {"mean": statistics.fmean(s), "median": statistics.median(s), "p99": p99}


def summarize(results: list[RequestResult], duration: float, slos: dict[str, float]) -> dict:
    ok = [r for r in results if r.ok]
    tpots = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    good = 0
    for r in ok:
        tpot = (r.e2e - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0
        met = {"ttft": r.ttft, "tpot": tpot, "e2el": r.e2e}
        if all(met[k] * 1000.0 <= v for k, v in slos.items()):
            good += 1
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    ms = lambda d: {k: v * 1000.0 for k, v in d.items()}  # noqa: E731
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:10],
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": out_tokens / duration if duration > 0 else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration > 0 else 0.0,
        "ttft_ms": ms(_stats([r.ttft for r in ok])),
        "tpot_ms": ms(_stats(tpots)),
        "itl_ms": ms(_stats([g for r in ok for g in r.itl])),
        "e2el_ms": ms(_stats([r.e2e for r in ok])),
        "goodput": (good / duration if duration > 0 else 0.0) if slos else None,
        "slos_ms": slos or None,
    }


async def benchmark(
    args: argparse.Namespace, prompts: list[BenchPrompt] | None = None
) -> tuple[dict, list[RequestResult]]:
    """Runs the load test; `prompts` (e.g. token ids shared with an offline run) replaces the dataset flags."""
    slos = parse_goodput(args.goodput)
    if prompts is None:
        prompts = make_prompts(args.dataset, args.num_prompts, args.input_len, args.output_len, args.random_range_ratio, args.seed)
    delays = arrival_delays(len(prompts), args.request_rate, args.burstiness, random.Random(args.seed + 1))
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    base = args.base_url.rstrip("/")
    chat = "chat" in args.endpoint
    if chat and any(not isinstance(p.prompt, str) for p in prompts):
        raise ValueError("token-id prompts need the /v1/completions endpoint")
    limit = args.max_concurrency or len(prompts)
    backend = getattr(args, "http_client", None) or default_http_client()
    async with _client(backend, limit) as client:
        stream_cls = _AiohttpStream if backend == "aiohttp" else _HttpxStream
        model = args.model
        if model is None:
            model = (await _get_json(backend, client, f"{base}/v1/models", headers))["data"][0]["id"]
        sem = asyncio.Semaphore(limit)

        async def run_one(p: BenchPrompt) -> RequestResult:
            payload = {"model": model, "max_tokens": p.output_len, "stream": True, "ignore_eos": True,
                       "temperature": 0.0, "stream_options": {"include_usage": True}}
            if chat:
                payload["messages"] = [{"role": "user", "content": p.prompt}]
            else:
                payload["prompt"] = p.prompt
            async with sem:
                return await _one_request(stream_cls, client, base + args.endpoint, payload, headers, args.timeout)

        t0 = time.perf_counter()
        tasks = []
        for p, delay in zip(prompts, delays):
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(run_one(p)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    summary = summarize(list(results), duration, slos)
    summary.update(model=model, base_url=base, endpoint=args.endpoint, dataset=args.dataset, http_client=backend,
                   num_prompts=len(prompts), request_rate=args.request_rate, burstiness=args.burstiness,
                   max_concurrency=args.max_concurrency)
    return summary, list(results)


def _print(summary: dict) -> None:
    print(f"{'=' * 14} Serving Benchmark Result {'=' * 14}")
    print(f"Successful requests:      {summary['completed']}")
    print(f"Failed requests:          {summary['failed']}")
    print(f"Duration (s):             {summary['duration_s']:.2f}")
    print(f"Request throughput (r/s): {summary['request_throughput']:.2f}")
    print(f"Output tokens/s:          {summary['output_throughput']:.2f}")
    print(f"Total tokens/s:           {summary['total_token_throughput']:.2f}")
    if summary["goodput"] is not None:
        print(f"Goodput (r/s):            {summary['goodput']:.2f}")
    for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2el_ms", "E2E")):
        s = summary[key]
        print(f"{name + ' (ms)':<10} mean {s['mean']:9.2f}  median {s['median']:9.2f}  p99 {s['p99']:9.2f}")
    for err in summary["errors"]:
        print(f"error: {err}")


def _plot(path: str, results: list[RequestResult]) -> None:
    from pagedllm.entrypoints.bench.plots import plot_serve

    ok = [r for r in results if r.ok]
    plot_serve(path, [r.start for r in ok], [r.ttft for r in ok], [g for r in ok for g in r.itl], [r.e2e for r in ok])


def run(args: argparse.Namespace) -> dict:
    from pagedllm.entrypoints.bench.plots import require_matplotlib

    require_matplotlib(args.plot)
    summary, results = asyncio.run(benchmark(args))
    _print(summary)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(summary, f, indent=2)
    if args.plot:
        _plot(args.plot, results)
    return summary
