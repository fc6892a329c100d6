"""Serving-path latency on loopback: the TTFT a client sees for lone requests, against the server's own TTFT.

Starts `pagedllm serve` with the given model and flags, warms it up, then sends --requests streamed
/v1/completions one after another (token prompts of --input-len ids, --max-tokens tokens, EOS ignored),
each over a kept-alive raw socket, so the client adds next to nothing. For each it records the time
from the first byte sent to the first SSE event, and to the end of the stream. The server's own TTFT
(arrival at the front end to the first token there) comes from the difference of its /metrics
histogram sums before and after, so "client − server" is the HTTP path both ways: parsing, routing,
validation, the response's headers and first chunk, and the loopback hops. --background-streams K
keeps K long requests decoding meanwhile, so the same split is seen under load. Prints a line;
--json writes the figures.

    python benchmarks/serve_latency.py --model DIR [--serve-flags "--device cpu --dtype float32"]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import socket
import statistics
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from serve_process import Server  # noqa: E402 - a sibling module of this script


def _metric_sum_count(url: str, name: str) -> tuple[float, float]:
    import httpx

    text = httpx.get(url + "/metrics", timeout=10).text
    total = count = 0.0
    for line in text.splitlines():
        if line.startswith(f"pagedllm:{name}_sum"):
            total += float(line.rsplit(" ", 1)[1])
        elif line.startswith(f"pagedllm:{name}_count"):
            count += float(line.rsplit(" ", 1)[1])
    return total, count


class RawClient:
    """One kept-alive HTTP/1.1 connection; reads chunked SSE responses by hand."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""

    def _fill(self) -> None:
        data = self.sock.recv(65536)
        if not data:
            raise ConnectionError("the server closed the connection")
        self.buf += data

    def _read_line(self) -> bytes:
        while b"\r\n" not in self.buf:
            self._fill()
        line, self.buf = self.buf.split(b"\r\n", 1)
        return line

    def _read_exact(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._fill()
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def stream(self, body: dict) -> tuple[float, float, int]:
        """(seconds to the first SSE event, seconds to the end, events) of one streamed request."""
        payload = json.dumps(body).encode()
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{self.port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n"
        ).encode()
        t0 = time.perf_counter()
        self.sock.sendall(head + payload)
        status = self._read_line()
        if b" 200 " not in status:
            raise RuntimeError(f"HTTP status {status!r}")
        while self._read_line():  # headers, up to the blank line
            pass
        first = None
        events = 0
        pending = b""
        while True:
            size = int(self._read_line().split(b";")[0], 16)
            chunk = self._read_exact(size + 2)[:size]
            if size == 0:
                break
            pending += chunk
            while b"\n\n" in pending:
                event, pending = pending.split(b"\n\n", 1)
                if first is None:
                    first = time.perf_counter() - t0
                events += 1
        return first or 0.0, time.perf_counter() - t0, events


def _background_stream(port: int, body: dict, done: list) -> None:
    """One long streamed request, as a stream that keeps the server decoding; appends its end time."""
    RawClient(port).stream(body)
    done.append(time.perf_counter())


def run(args) -> dict:
    flags = [args.model, *shlex.split(args.serve_flags), "--disable-access-log"]
    server = Server(flags, log_path=args.log)
    try:
        server.wait_healthy(args.start_timeout)
        client = RawClient(server.port)
        rng = random.Random(0)

        def body() -> dict:
            ids = [rng.randrange(1000, args.vocab) for _ in range(args.input_len)]
            return {"model": args.served_name, "prompt": ids, "max_tokens": args.max_tokens, "stream": True,
                    "ignore_eos": True, "temperature": 0.0}

        for _ in range(args.warmup):
            client.stream(body())
        ended: list[float] = []
        background = [
            threading.Thread(target=_background_stream, args=(server.port, {**body(), "max_tokens": args.background_tokens},
                                                              ended), daemon=True)
            for _ in range(args.background_streams)
        ]
        for t in background:
            t.start()
        # Their first tokens must land before the first scrape, so that the server's mean is ours alone.
        time.sleep(1.0 if background else 0.0)
        s0, c0 = _metric_sum_count(server.url, "time_to_first_token_seconds")
        firsts, ends = [], []
        for _ in range(args.requests):
            first, end, _events = client.stream(body())
            firsts.append(first)
            ends.append(end)
            time.sleep(args.gap_s)
        s1, c1 = _metric_sum_count(server.url, "time_to_first_token_seconds")
        if ended:
            raise RuntimeError("a background stream ended during the measurement: raise --background-tokens")
        for t in background:
            t.join(timeout=600)
    finally:
        server.stop()
    n = c1 - c0
    server_mean = (s1 - s0) / n if n else float("nan")
    ms = lambda xs: [round(x * 1e3, 3) for x in xs]  # noqa: E731
    return {
        "requests": args.requests,
        "client_ttft_ms": {"median": statistics.median(ms(firsts)), "mean": statistics.fmean(ms(firsts)),
                           "min": min(ms(firsts))},
        "server_ttft_mean_ms": round(server_mean * 1e3, 3),
        "client_minus_server_mean_ms": round(statistics.fmean(firsts) * 1e3 - server_mean * 1e3, 3),
        "e2e_ms": {"median": statistics.median(ms(ends))},
        "background_streams": args.background_streams,
        "serve_flags": args.serve_flags,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--served-name", default=None, help="the model name to send (default: --model)")
    ap.add_argument("--serve-flags", default="--device cpu --dtype float32")
    ap.add_argument("--vocab", type=int, default=32000, help="prompt ids are drawn from [1000, vocab)")
    ap.add_argument("--input-len", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=2)
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--gap-s", type=float, default=0.02, help="pause between requests")
    ap.add_argument("--background-streams", type=int, default=0,
                    help="long requests kept decoding meanwhile, as under load")
    ap.add_argument("--background-tokens", type=int, default=2000,
                    help="output tokens of each background request: enough to outlast the measurement")
    ap.add_argument("--start-timeout", type=float, default=300.0)
    ap.add_argument("--log", default=None, help="the server's output goes here")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    args.served_name = args.served_name or args.model
    res = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    c = res["client_ttft_ms"]
    print(f"client TTFT median {c['median']:.2f} ms (mean {c['mean']:.2f}, min {c['min']:.2f}); "
          f"server TTFT mean {res['server_ttft_mean_ms']:.2f} ms; client - server {res['client_minus_server_mean_ms']:.2f} ms; "
          f"e2e median {res['e2e_ms']['median']:.2f} ms")


if __name__ == "__main__":
    main()
