"""Slow and greedy clients against the "limits" server (1-second header, body and keep-alive timeouts,
--limit-concurrency 4): each is closed or refused in bounded time while /health keeps answering. Then
SIGTERM under load on a server of its own: in-flight requests finish within --shutdown-timeout, the
rest end with an OpenAI-shaped error, and the process exits 0 leaving no socket directory or child."""
from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
from serve_helpers import Server, make_model, sse_events

MODEL = "tiny-qwen"


def _connect(server: Server) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    return sock


def _read_until_closed(sock: socket.socket, limit_s: float = 10.0) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and the seconds that took."""
    start = time.monotonic()
    sock.settimeout(limit_s)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data, time.monotonic() - start


def _status(response: bytes) -> int:
    return int(response.split(b" ", 2)[1]) if response.startswith(b"HTTP/1.1 ") else 0


def _json_body(response: bytes) -> dict:
    return json.loads(response.split(b"\r\n\r\n", 1)[1])


def _health_ok(server: Server) -> None:
    start = time.monotonic()
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
    assert time.monotonic() - start < 2


def _wait_in_engine(server: Server, count: int, limit_s: float) -> bool:
    """True once /metrics counts `count` requests running or waiting in the engine core."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        text = httpx.get(f"{server.url}/metrics", timeout=5).text
        held = sum(
            float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith(("pagedllm:num_requests_running{", "pagedllm:num_requests_waiting{"))
        )
        if held >= count:
            return True
        time.sleep(0.05)
    return False


def test_partial_headers_are_closed_within_the_header_timeout(limits_server):
    socks = [_connect(limits_server) for _ in range(20)]
    for s in socks:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: a")
    # 20 connections past --limit-concurrency 4, all stuck in their headers: /health still answers.
    _health_ok(limits_server)
    for s in socks:
        data, took = _read_until_closed(s)
        s.close()
        assert took < 4, took
        assert _status(data) == 408, data[:200]
        err = _json_body(data)["error"]
        assert err["code"] == "request_timeout" and "headers did not arrive within 1 s" in err["message"], err
    _health_ok(limits_server)


def test_trickled_headers_do_not_extend_the_deadline(limits_server):
    sock = _connect(limits_server)
    start = time.monotonic()
    sock.settimeout(10)
    closed_after = None
    try:
        for byte in b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 40:
            sock.sendall(bytes([byte]))
            time.sleep(0.2)  # well under the 1 s timeout between two bytes
    except OSError:
        closed_after = time.monotonic() - start
    data, _ = _read_until_closed(sock)
    sock.close()
    assert (closed_after or time.monotonic() - start) < 4
    assert data == b"" or _status(data) == 408, data[:200]


def test_an_idle_connection_is_closed(limits_server):
    sock = _connect(limits_server)
    data, took = _read_until_closed(sock)
    sock.close()
    assert took < 4 and _status(data) == 408, (took, data[:200])


def test_a_body_shorter_than_its_content_length_is_closed_within_the_body_timeout(limits_server):
    sock = _connect(limits_server)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 1000\r\n\r\n{\"model\": \"tiny-qwen\""
    )
    data, took = _read_until_closed(sock)
    sock.close()
    assert took < 4, took
    assert _status(data) == 408, data[:200]
    assert "body stalled for more than 1 s" in _json_body(data)["error"]["message"]
    _health_ok(limits_server)


def test_a_slow_body_with_short_pauses_is_served(limits_server):
    body = json.dumps({"model": MODEL, "prompt": "Slow", "max_tokens": 1}).encode()
    sock = _connect(limits_server)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body)
    )
    for i in range(0, len(body), len(body) // 3 + 1):
        time.sleep(0.5)  # the timeout is between two pieces, not for the whole body
        sock.sendall(body[i : i + len(body) // 3 + 1])
    data, _ = _read_until_closed(sock, 60)
    sock.close()
    assert _status(data) == 200, data[:300]


def test_oversized_headers_are_refused_without_reading_them(limits_server):
    sock = _connect(limits_server)
    sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")
    sent = 0
    line = b"X-Big: " + b"a" * (64 * 1024 - 9) + b"\r\n"
    try:
        for _ in range(128):  # 8 MB of headers, unless the server stops us first
            sock.sendall(line)
            sent += len(line)
            time.sleep(0.005)  # lets the server read as we go, so kernel buffers hold little
    except OSError:
        pass
    data, _ = _read_until_closed(sock)
    sock.close()
    # The protocol's cap (--max-header-bytes plus 8 KiB) stops reading: the client cannot push megabytes.
    assert sent < 1 << 20, sent
    assert data == b"" or _status(data) == 431, data[:200]
    _health_ok(limits_server)


def test_past_limit_concurrency_requests_get_503_but_health_answers(limits_server):
    idle = [_connect(limits_server) for _ in range(4)]
    try:
        r = httpx.get(f"{limits_server.url}/v1/models", timeout=5)
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["code"] == "too_many_connections" and "--limit-concurrency" in err["message"]
        assert r.headers["retry-after"] == "1"
        _health_ok(limits_server)
    finally:
        for s in idle:
            s.close()
    deadline = time.monotonic() + 5
    while httpx.get(f"{limits_server.url}/v1/models", timeout=5).status_code != 200:
        assert time.monotonic() < deadline, "still refused after the idle connections closed"
        time.sleep(0.1)


def test_an_idle_keep_alive_connection_is_closed_after_timeout_keep_alive(limits_server):
    sock = _connect(limits_server)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    data, took = _read_until_closed(sock)
    sock.close()
    assert _status(data) == 200 and took < 4, (took, data[:200])


# ---- SIGTERM ------------------------------------------------------------------------------------------
SHUTDOWN_TIMEOUT_S = 4


@pytest.fixture(scope="module")
def own_model(tmp_path_factory) -> str:
    return make_model("qwen3", tmp_path_factory.mktemp("model") / "qwen3", tie=True)


def test_sigterm_during_start_up_stops_the_engine_core(tmp_path, own_model):
    (tmp_path / "tmp").mkdir()
    server = Server("starting", own_model, ["--served-model-name", MODEL], tmp_path, env={"TMPDIR": str(tmp_path / "tmp")})
    try:
        deadline = time.monotonic() + 60
        core = None
        while core is None:
            assert server.proc.poll() is None and time.monotonic() < deadline, server.log_tail()
            time.sleep(0.05)
            try:
                core = server.core_pid()
            except AssertionError:  # not spawned yet
                pass
        server.proc.send_signal(signal.SIGTERM)  # while the engine core is still being built
        assert server.proc.wait(timeout=30) == 0, server.log_tail()
    finally:
        server.stop()
    assert "Application startup complete" not in server.log_tail(), "the signal came too late to test start-up"
    assert not list((tmp_path / "tmp").glob("pagedllm-core-*")), server.log_tail()
    assert not Path(f"/proc/{core}").exists(), server.log_tail()


@pytest.fixture(scope="module")
def draining_server(tmp_path_factory, own_model):
    # Its own server (this test ends it), with a private temporary directory so that its engine
    # core's socket directory can be found.
    root = tmp_path_factory.mktemp("draining")
    (root / "tmp").mkdir()
    server = Server(
        "draining", own_model,
        ["--served-model-name", MODEL, "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S), "--max-model-len", "2048"],
        root, env={"TMPDIR": str(root / "tmp")},
    )
    yield server.wait_ready(), root / "tmp"
    server.stop()


def test_sigterm_drains_in_flight_requests_then_exits_cleanly(draining_server):
    server, tmpdir = draining_server
    url = f"{server.url}/v1/completions"
    assert list(tmpdir.glob("pagedllm-core-*")), "the engine core's socket directory is not where expected"
    core = server.core_pid()
    children = server.children()
    assert core in children
    long_body = {"model": MODEL, "prompt": "Long", "max_tokens": 2000, "temperature": 0, "ignore_eos": True}
    short_body = {"model": MODEL, "prompt": "Short", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    results: dict = {}
    started = {name: threading.Event() for name in ("long_stream", "short_stream")}

    def stream(name: str, body: dict) -> None:
        with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as r:
            lines = []
            for line in r.iter_lines():
                lines.append(line)
                if line.startswith("data: "):
                    started[name].set()
            results[name] = (r.status_code, sse_events(lines))

    def full(name: str, body: dict) -> None:
        results[name] = httpx.post(url, json=body, timeout=60)

    threads = [
        threading.Thread(target=stream, args=("long_stream", long_body)),
        threading.Thread(target=full, args=("long_full", long_body)),
        threading.Thread(target=stream, args=("short_stream", short_body)),
        threading.Thread(target=full, args=("short_full", short_body)),
    ]
    for t in threads:
        t.start()
    for name, event in started.items():
        assert event.wait(60), f"{name} never started:\n{server.log_tail()}"
    # The non-streaming requests show no progress to the client: wait until the engine holds all four,
    # or SIGTERM may land before one was sent and it would rightly be refused.
    assert _wait_in_engine(server, 4, 60), f"not all four requests reached the engine:\n{server.log_tail()}"
    signalled = time.monotonic()
    # To the server and every child, as a supervisor that signals the whole group does (systemd): the
    # engine core must keep serving the drain.
    for pid in [server.proc.pid, *children]:
        os.kill(pid, signal.SIGTERM)
    time.sleep(0.5)
    # Not taken any more: refused at the socket, or a 503 while in-flight requests drain.
    try:
        r = httpx.post(url, json=short_body, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutting_down", r.text
    except httpx.TransportError:
        pass
    for t in threads:
        t.join(SHUTDOWN_TIMEOUT_S + 30)
    code = server.proc.wait(timeout=30)
    took = time.monotonic() - signalled
    log = server.log_tail(8000)
    assert code == 0, log
    assert took < SHUTDOWN_TIMEOUT_S + 10, took

    # Requests that could finish within the drain time did so normally.
    status, events = results["short_stream"]
    assert status == 200 and events[-1] == "[DONE]", events[-3:]
    assert not any("error" in e for e in events[:-1])
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    full_short = results["short_full"]
    assert full_short.status_code == 200 and full_short.json()["usage"]["completion_tokens"] == 24, full_short.text
    # The others ended with an OpenAI-shaped 503: an error event then [DONE], or a JSON body.
    status, events = results["long_stream"]
    assert status == 200 and events[-1] == "[DONE]", events[-3:]
    err = events[-2]["error"]
    assert err["code"] == "server_shutting_down" and err["type"] == "service_unavailable", err
    assert "--shutdown-timeout" in err["message"]
    full_long = results["long_full"]
    assert full_long.status_code == 503 and full_long.json()["error"]["code"] == "server_shutting_down", full_long.text

    # The engine core was stopped and reaped before the server exited, its sockets removed; the rest
    # (multiprocessing's resource tracker) end when the server's end of their pipe closes.
    assert not list(tmpdir.glob("pagedllm-core-*")), list(tmpdir.iterdir())
    assert not Path(f"/proc/{core}").exists(), f"engine core {core} is left behind:\n{log}"
    deadline = time.monotonic() + 5
    while any(Path(f"/proc/{pid}").exists() for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [pid for pid in children if Path(f"/proc/{pid}").exists()]
    assert not left, [Path(f"/proc/{pid}/stat").read_text() for pid in left]
    assert "SIGTERM" in log and "engine core stopped" in log, log
