"""Serving soak: many streamed requests, some dropped by the client mid-stream, and what the server keeps.

Sends --requests streamed /v1/completions (EOS ignored, --max-tokens each) at --concurrency at a time;
a --drop-fraction of them is closed by the client after a random number of events. Meanwhile it
samples the resident memory (RSS) of every process of the server (the front end and the engine core,
psutil over the process tree) and, from a separate process so the client's own load does not count,
the latency of /health. It then checks and prints:

- sent = completed + aborted, as the server's /metrics counts them (`pagedllm:request_success_total`
  by finish reason), and no request failed;
- `pagedllm:kv_cache_usage_perc` is 0 once the server has drained;
- each process's RSS is flat after warm-up (the first --warmup-fraction of the requests, by which
  point the KV cache has been touched once): first sample after warm-up, last sample, least-squares slope;
- /health latency max and p99 stay under --health-target-ms.

It exits non-zero if a check fails. By default it starts `pagedllm serve` on a tiny random Llama with
a real tokenizer (built as the server tests build theirs); --model serves a model of yours, --base-url
soaks a server that is already running (give --server-pid for the RSS figures).

    python benchmarks/soak.py [--requests 2000 --concurrency 32 --drop-fraction 0.1] [--output-json FILE]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import shlex
import statistics
import sys
import tempfile
import threading
import time

from pagedllm import envs

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from serve_process import Server, tail  # noqa: E402 - a sibling module of this script

WORDS = "the quick brown fox jumps over a lazy dog while seven wise owls watch from old oak trees".split()


def tiny_model(path: str) -> str:
    """A tiny random Llama with the Mistral tokenizer's vocabulary (the server tests' model)."""
    tests = os.path.join(os.path.dirname(HERE), "tests")
    for d in (tests, os.path.join(tests, "entrypoints")):
        if d not in sys.path:
            sys.path.insert(0, d)
    from serve_helpers import make_model
    from pathlib import Path

    return make_model("mistral", Path(path))


# ---- /metrics --------------------------------------------------------------------------------------
def read_metrics(url: str, headers: dict) -> dict[str, float]:
    """`pagedllm:` samples summed over labels except finish reason: {"request_success_total{stop}": n, ...}."""
    import httpx

    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", headers=headers, timeout=30).text.splitlines():
        if not line.startswith("pagedllm:"):
            continue
        name_labels, value = line.rsplit(" ", 1)
        name = name_labels.split("{", 1)[0]
        if name == "pagedllm:request_success_total":
            reason = name_labels.split('finished_reason="', 1)[1].split('"', 1)[0]
            name = f"{name}{{{reason}}}"
        out[name] = out.get(name, 0.0) + float(value)
    return out


def finished(m: dict[str, float], reason: str) -> float:
    return m.get(f"pagedllm:request_success_total{{{reason}}}", 0.0)


# ---- /health prober (its own process) --------------------------------------------------------------
def probe_health(url: str, interval_s: float, stop, conn) -> None:
    import httpx

    samples: list[tuple[float, float, int]] = []
    with httpx.Client(timeout=30) as client:
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                status = client.get(url + "/health").status_code
            except httpx.HTTPError:
                status = -1
            samples.append((time.time(), (time.perf_counter() - t0) * 1e3, status))
            time.sleep(max(0.0, interval_s - (time.perf_counter() - t0)))
    conn.send(samples)


# ---- RSS sampler (a thread) ------------------------------------------------------------------------
class RssSampler:
    """RSS of `pid` and all its descendants every `interval_s`, with the count of requests done."""

    def __init__(self, pid: int, interval_s: float, progress) -> None:
        import psutil

        self.root = psutil.Process(pid)
        self.interval_s = interval_s
        self.progress = progress
        self.samples: list[dict] = []
        self.roles: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _role(self, proc) -> str:
        if proc.pid == self.root.pid:
            return "front-end"
        try:
            cmd = " ".join(proc.cmdline())
        except Exception:  # noqa: BLE001 - gone or unreadable
            cmd = ""
        if "resource_tracker" in cmd:
            return "resource-tracker"
        return "engine-core" if "spawn_main" in cmd else f"child {proc.pid}"

    def sample(self) -> None:
        import psutil

        rss: dict[int, float] = {}
        for proc in [self.root, *self.root.children(recursive=True)]:
            try:
                rss[proc.pid] = proc.memory_info().rss / 2**20
                self.roles.setdefault(proc.pid, self._role(proc))
            except psutil.Error:
                pass
        self.samples.append({"t": time.time(), "done": self.progress(), "rss_mib": rss})

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def start(self) -> None:
        self.sample()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    def series(self, points: int = 60) -> list[dict]:
        """About `points` samples, evenly spaced: seconds from the start, requests done, MiB by process."""
        t0, every = self.samples[0]["t"], max(1, len(self.samples) // points)
        picked = self.samples[::every] + ([self.samples[-1]] if (len(self.samples) - 1) % every else [])
        return [{"s": round(x["t"] - t0, 1), "done": x["done"],
                 "mib": {f"{self.roles[pid]} ({pid})": round(v, 1) for pid, v in x["rss_mib"].items()}} for x in picked]

    def report(self, warm_done: int) -> dict:
        """Per process: RSS at the first sample after warm-up and at the last, and the slope after warm-up."""
        out = {}
        for pid, role in self.roles.items():
            pts = [(s["t"], s["done"], s["rss_mib"][pid]) for s in self.samples if pid in s["rss_mib"]]
            warm = [p for p in pts if p[1] >= warm_done] or pts[-1:]
            t0 = warm[0][0]
            xs = [(t - t0) / 60 for t, _, _ in warm]
            ys = [r for _, _, r in warm]
            slope = statistics.linear_regression(xs, ys).slope if len(set(xs)) > 1 else 0.0
            out[f"{role} ({pid})"] = {
                "role": role, "start_mib": round(pts[0][2], 1), "peak_mib": round(max(r for _, _, r in pts), 1),
                "after_warmup_mib": round(ys[0], 1), "last_mib": round(ys[-1], 1),
                "growth_after_warmup_mib": round(ys[-1] - ys[0], 1), "slope_mib_per_min": round(slope, 3),
                "samples_after_warmup": len(warm),
            }
        return out


# ---- the load --------------------------------------------------------------------------------------
class Load:
    def __init__(self, args, url: str, headers: dict, model: str) -> None:
        self.args, self.url, self.headers, self.model = args, url, headers, model
        self.rng = random.Random(args.seed)
        self.completed = self.dropped = 0
        self.errors: list[str] = []

    @property
    def done(self) -> int:
        return self.completed + self.dropped + len(self.errors)

    def body(self) -> dict:
        words = self.rng.randint(self.args.prompt_words // 2, self.args.prompt_words)
        prompt = " ".join(self.rng.choice(WORDS) for _ in range(words))
        return {"model": self.model, "prompt": prompt, "max_tokens": self.args.max_tokens, "stream": True,
                "ignore_eos": True, "temperature": 1.0, "seed": self.rng.randrange(2**31)}

    async def one(self, client, body: dict, drop_after: int | None) -> None:
        import httpx

        events = 0
        try:
            async with client.stream("POST", self.url + "/v1/completions", json=body, headers=self.headers) as r:
                if r.status_code != 200:
                    self.errors.append(f"{r.status_code} {(await r.aread())[:300]!r}")
                    return
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[len("data: "):]
                    if data == "[DONE]":
                        self.completed += 1
                        return
                    if "error" in json.loads(data):
                        self.errors.append(f"error event {data[:300]}")
                        return
                    events += 1
                    if drop_after is not None and events >= drop_after:
                        # Leaving the block closes the connection with the body unread: the client is gone.
                        self.dropped += 1
                        return
            self.errors.append(f"stream ended without [DONE] after {events} events")
        except httpx.HTTPError as e:
            self.errors.append(f"{type(e).__name__}: {e}")

    async def run(self, n: int) -> None:
        import httpx

        plan = [self.rng.randint(1, max(1, self.args.max_tokens - 1)) if self.rng.random() < self.args.drop_fraction
                else None for _ in range(n)]
        queue: asyncio.Queue = asyncio.Queue()
        for drop_after in plan:
            queue.put_nowait(drop_after)
        limits = httpx.Limits(max_connections=self.args.concurrency, max_keepalive_connections=self.args.concurrency)
        async with httpx.AsyncClient(timeout=httpx.Timeout(300, connect=30), limits=limits) as client:

            step, t0 = max(1, n // 10), time.perf_counter()
            reported = [0]

            async def worker() -> None:
                while not queue.empty():
                    await self.one(client, self.body(), queue.get_nowait())
                    if self.done // step > reported[0]:
                        reported[0] = self.done // step
                        print(f"  {self.done}/{n} requests done, {time.perf_counter() - t0:.0f} s", flush=True)

            await asyncio.gather(*[worker() for _ in range(self.args.concurrency)])


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))] if s else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--drop-fraction", type=float, default=0.1)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--prompt-words", type=int, default=24, help="prompts of this many words at most (half at least)")
    ap.add_argument("--warmup-fraction", type=float, default=0.25,
                    help="requests before RSS counts as warm (by default the KV cache has been filled twice by then)")
    ap.add_argument("--health-interval-s", type=float, default=0.1)
    ap.add_argument("--health-target-ms", type=float, default=100.0)
    ap.add_argument("--rss-tolerance-mib", type=float, default=16.0, help="allowed RSS growth per process after warm-up")
    ap.add_argument("--rss-interval-s", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None, help="model to serve (default: a tiny random Llama built here)")
    ap.add_argument("--serve-flags", default="--device cpu --dtype float32 --max-model-len 256 "
                    "--kv-cache-memory-bytes 4194304 --disable-access-log --uvicorn-log-level warning")
    ap.add_argument("--base-url", default=None, help="soak this running server instead of starting one")
    ap.add_argument("--server-pid", type=int, default=None, help="with --base-url: the server's pid, for RSS")
    ap.add_argument("--api-key", default=envs.PAGEDLLM_API_KEY)
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()

    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    server = None
    workdir = tempfile.TemporaryDirectory(prefix="pagedllm-soak-")
    try:
        if args.base_url:
            url, pid = args.base_url.rstrip("/"), args.server_pid
        else:
            model = args.model or tiny_model(os.path.join(workdir.name, "model"))
            server = Server([model, *shlex.split(args.serve_flags)], os.path.join(workdir.name, "server.log"))
            print(f"server up in {server.wait_healthy(600):.1f} s", flush=True)
            url, pid = server.url, server.proc.pid
        model_name = httpx.get(url + "/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
        return soak(args, url, headers, model_name, pid, server)
    finally:
        if server is not None:
            server.stop()
        workdir.cleanup()


def soak(args, url: str, headers: dict, model_name: str, pid: int | None, server) -> int:
    load = Load(args, url, headers, model_name)
    before = read_metrics(url, headers)
    rss = RssSampler(pid, args.rss_interval_s, lambda: load.done) if pid else None
    ctx = mp.get_context("spawn")
    stop, (recv, send) = ctx.Event(), ctx.Pipe(duplex=False)
    prober = ctx.Process(target=probe_health, args=(url, args.health_interval_s, stop, send), daemon=True)
    prober.start()
    if rss:
        rss.start()
    t0 = time.perf_counter()
    asyncio.run(load.run(args.requests))
    elapsed = time.perf_counter() - t0

    # Drained: every request has ended on the client; the server's counters and gauges follow.
    deadline = time.monotonic() + 30
    while True:
        after = read_metrics(url, headers)
        ended = sum(finished(after, r) - finished(before, r) for r in ("stop", "length", "abort"))
        kv = after.get("pagedllm:kv_cache_usage_perc", float("nan"))
        if (ended >= args.requests and kv == 0) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    time.sleep(2 * args.rss_interval_s)
    if rss:
        rss.stop()
    stop.set()
    health = recv.recv()
    prober.join(30)

    completed = sum(finished(after, r) - finished(before, r) for r in ("stop", "length"))
    aborted = finished(after, "abort") - finished(before, "abort")
    lat = [ms for _, ms, _ in health]
    bad_health = [(round(ms, 1), status) for _, ms, status in health if status != 200]
    warm_done = int(args.requests * args.warmup_fraction)
    rss_report = rss.report(warm_done) if rss else {}
    res = {
        "config": {k: getattr(args, k) for k in ("requests", "concurrency", "drop_fraction", "max_tokens",
                                                 "prompt_words", "warmup_fraction", "seed", "serve_flags")},
        "base_url_given": bool(args.base_url),
        "elapsed_s": round(elapsed, 1),
        "requests_per_s": round(args.requests / elapsed, 2),
        "client": {"sent": args.requests, "completed": load.completed, "dropped": load.dropped,
                   "errors": len(load.errors), "first_errors": load.errors[:5]},
        "server": {"completed": completed, "aborted": aborted, "kv_cache_usage_after_drain": kv,
                   "generation_tokens": after.get("pagedllm:generation_tokens_total", 0.0)
                   - before.get("pagedllm:generation_tokens_total", 0.0)},
        "health": {"samples": len(lat), "p50_ms": round(percentile(lat, 50), 2), "p99_ms": round(percentile(lat, 99), 2),
                   "max_ms": round(max(lat), 2) if lat else None, "not_200": bad_health[:10]},
        "rss": rss_report,
        "rss_series": rss.series() if rss else [],
    }
    checks = {
        "sent == completed + aborted": completed + aborted == args.requests,
        "no request failed": not load.errors,
        "kv cache usage 0 after drain": kv == 0,
        f"/health max < {args.health_target_ms:g} ms": bool(lat) and max(lat) < args.health_target_ms and not bad_health,
        f"/health p99 < {args.health_target_ms:g} ms": bool(lat) and percentile(lat, 99) < args.health_target_ms,
    }
    for name, r in rss_report.items():
        if r["role"] in ("front-end", "engine-core"):
            checks[f"RSS flat after warm-up: {name}"] = abs(r["growth_after_warmup_mib"]) <= args.rss_tolerance_mib
    res["checks"] = checks
    res["passed"] = all(checks.values())

    print(f"{args.requests} requests in {elapsed:.1f} s ({res['requests_per_s']} req/s), concurrency "
          f"{args.concurrency}, {load.dropped} dropped by the client")
    print(f"server: completed {completed:.0f} + aborted {aborted:.0f} = {completed + aborted:.0f} "
          f"(sent {args.requests}); client errors {len(load.errors)}; KV cache usage after drain {kv:g}")
    print(f"/health: {len(lat)} samples, p50 {res['health']['p50_ms']} ms, p99 {res['health']['p99_ms']} ms, "
          f"max {res['health']['max_ms']} ms")
    for name, r in rss_report.items():
        print(f"RSS {name}: start {r['start_mib']} MiB, after warm-up {r['after_warmup_mib']}, last {r['last_mib']} "
              f"(growth {r['growth_after_warmup_mib']:+}), slope {r['slope_mib_per_min']:+} MiB/min, peak {r['peak_mib']}")
    for name, ok in checks.items():
        print(f"  [{'ok' if ok else 'FAIL'}] {name}")
    if load.errors:
        print("first errors:", *load.errors[:5], sep="\n  ")
    if server is not None and not res["passed"]:
        print("server log tail:\n" + tail(server.log_path))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(res, f, indent=2)
    return 0 if res["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
