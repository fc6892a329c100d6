"""H200 serving benchmark: `pagedllm serve` latency at 4 req/s and throughput at 256 streams vs offline.

Llama-3-8B shape, random weights (--load-format dummy), bf16, greedy, EOS ignored (fixed lengths):

  (a) latency: --request-rate 4 (Poisson), 120 prompts of 1000 input / 128 output tokens;
      targets: median TTFT <= 25 ms, median ITL <= 6 ms.
  (b) throughput: --request-rate inf, 256 prompts of 1000 input / 256 output tokens, all 256 streams at
      once; output tok/s, compared with `pagedllm bench throughput` on the same token prompts and output
      lengths (target: served >= 0.9 x offline).

Steps: start `pagedllm serve` (its own session, 127.0.0.1, a free port, log in OUT/server.log), wait for
/health, warm it up (bursts of 1, 16 and 17 requests of 8 output tokens: Triton compiles its batch-size
variants there, not in a timed run), run the project's bench-serve client in this process for (a) then
(b), stop the server (SIGTERM to its whole process group, engine core included), then run
`pagedllm bench throughput` in a fresh process on the freed GPU (log in OUT/offline.log). Then, for
information (--no-offline-warm skips it), the same offline run once more in another fresh process but
after the same warm-up bursts, as the server had (OUT/offline_warm.log): `bench throughput` times its
first generate call, first-call costs included. Prints a table last; writes OUT/h200_serve.json.

Same prompts: `bench serve` builds text prompts and `bench throughput` random token ids, so (b) sends
the token ids that `bench throughput` builds itself (pagedllm.entrypoints.bench.datasets.random_requests with
the same count, lengths, range ratio, seed and the model's vocab_size) as token prompts; the offline
run is checked to have read and produced exactly as many tokens, the warm one to hash to the same
prompts. (a) uses other token prompts (seed + 1) and the warm-up others again, so no prefix-cache hit
carries over between phases. The server runs with the same engine flags and seed as the offline runs
(the same dummy weights), and all detokenize (--tokenizer). TTFT and ITL are bench serve's: ITL is the
gap between streamed chunks that carry text (a token whose text the detokenizer holds back, e.g. part of
a UTF-8 character, merges two gaps).

Sizes are flags; defaults as above. Expected wall time on an H200: ~4 min (server start ~25-40 s,
warm-up ~5 s, (a) ~32 s, (b) ~10-15 s, stop ~5 s, each offline process ~25-40 s start + ~10 s).

    python3 benchmarks/h200_serve.py --out DIR --tokenizer .bench_assets/llama3

Tiny CPU check of the script itself (a tiny HF checkpoint directory as --model):

    python benchmarks/h200_serve.py --out /tmp/hs --model TINY --tokenizer TOK --dtype float32 \\
        --extra-engine-args "--device cpu --max-num-seqs 8" --latency-prompts 6 --latency-input-len 32 \\
        --latency-output-len 8 --throughput-prompts 8 --throughput-input-len 32 --throughput-output-len 16
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import shlex
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from pagedllm.entrypoints.bench import serve as bench_serve  # noqa: E402 - stdlib only until the client runs (httpx)
from pagedllm.entrypoints.bench.datasets import random_requests  # noqa: E402
from serve_process import CLI, Server, child_env, tail  # noqa: E402 - a sibling module of this script

LLAMA_8B = os.path.join(HERE, "shapes", "llama-3-8b")


def log(msg: str) -> None:
    print(f"[h200_serve {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def model_vocab_size(model: str, load_format: str) -> int:
    """The vocab_size the engine uses (ModelConfig.vocab_size = the text config's vocab_size)."""
    cfg_path = os.path.join(model, "config.json")
    if os.path.isfile(cfg_path):
        with open(cfg_path) as f:
            cfg = json.load(f)
        vocab = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")
        if vocab:
            return int(vocab)
    from pagedllm.model_loader.model_source import load_model_source

    return int(load_model_source(model, None, load_format, None, False).hf_config.vocab_size)


def fingerprint(reqs) -> str:
    h = hashlib.sha256()
    for r in reqs:
        h.update(json.dumps([r.prompt_token_ids, r.output_len]).encode())
    return h.hexdigest()


def client_args(args, url: str, rate: float, seed: int, max_concurrency: int | None, n: int) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    bench_serve.add_cli_args(p)
    argv = ["--base-url", url, "--model", "bench", "--request-rate", str(rate), "--num-prompts", str(n),
            "--seed", str(seed), "--timeout", str(args.request_timeout)]
    if max_concurrency:
        argv += ["--max-concurrency", str(max_concurrency)]
    if args.http_client:
        argv += ["--http-client", args.http_client]
    return p.parse_args(argv)


def time_left(args, floor: float = 30.0) -> float:
    return max(floor, args.deadline - time.perf_counter())


def run_client(args, url: str, reqs, rate: float, seed: int, max_concurrency: int | None = None) -> dict:
    prompts = [bench_serve.BenchPrompt(r.prompt_token_ids, r.output_len) for r in reqs]
    cargs = client_args(args, url, rate, seed, max_concurrency, len(prompts))
    # The whole phase is bounded by what is left of --budget-s, so a stuck server cannot eat the run.
    summary, results = asyncio.run(asyncio.wait_for(bench_serve.benchmark(cargs, prompts), time_left(args)))
    bench_serve._print(summary)
    # The TTFT distribution, not just its median: queueing shows in its spread.
    ttfts = sorted(r.ttft * 1e3 for r in results if r.ok)
    if ttfts:
        summary["ttft_ms_quantiles"] = {f"p{q}": ttfts[min(len(ttfts) - 1, q * len(ttfts) // 100)]
                                        for q in (0, 10, 25, 50, 75, 90)}
    summary["requested_output_tokens"] = sum(r.output_len for r in reqs)
    summary["requested_input_tokens"] = sum(len(r.prompt_token_ids) for r in reqs)
    return summary


def warm_up(args, url: str, vocab: int) -> dict:
    """Bursts of 1, 16 and 17 requests (Triton specialises sizes == 1, multiples of 16, others)."""
    t0 = time.perf_counter()
    failed = 0
    for i, n in enumerate((1, 16, 17)):
        reqs = random_requests(n, args.warmup_input_len, 8, vocab, 0.0, seed=args.seed + 1000 + i)
        s = run_client(args, url, reqs, float("inf"), args.seed + 1000 + i)
        failed += s["failed"]
    return {"warmup_s": time.perf_counter() - t0, "failed": failed}


# Server-side histograms whose means split a client TTFT: the core's queue, first scheduled to first token
# in the core, and arrival at the front-end to first token.
SERVER_HISTOGRAMS = ("pagedllm:request_queue_time_seconds", "pagedllm:request_prefill_time_seconds",
                     "pagedllm:time_to_first_token_seconds")


def scrape_histograms(url: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of each of SERVER_HISTOGRAMS, summed over label sets, from the server's /metrics."""
    import httpx

    text = httpx.get(url + "/metrics", timeout=10.0).text
    out = {name: [0.0, 0.0] for name in SERVER_HISTOGRAMS}
    for line in text.splitlines():
        for name in SERVER_HISTOGRAMS:
            for i, suffix in enumerate(("_sum", "_count")):
                if line.startswith(name + suffix + "{") or line.startswith(name + suffix + " "):
                    out[name][i] += float(line.rsplit(" ", 1)[1])
    return {k: (v[0], v[1]) for k, v in out.items()}


def histogram_means_ms(before: dict, after: dict) -> dict[str, float | None]:
    """Mean of each histogram over the observations made between two scrapes, in ms."""
    means = {}
    for name in SERVER_HISTOGRAMS:
        n = after[name][1] - before[name][1]
        means[name.split(":", 1)[1] + "_mean_ms"] = (after[name][0] - before[name][0]) / n * 1e3 if n else None
    return means


# ---- offline ---------------------------------------------------------------------------------------------
def engine_flags_of(args) -> list[str]:
    """Engine flags shared by the server and both offline runs (same seed: the same dummy weights)."""
    return ["--model", args.model, "--tokenizer", args.tokenizer, "--load-format", args.load_format,
            "--dtype", args.dtype, "--seed", str(args.seed), *shlex.split(args.extra_engine_args)]


def throughput_flags(args) -> list[str]:
    return ["--num-prompts", str(args.throughput_prompts), "--input-len", str(args.throughput_input_len),
            "--output-len", str(args.throughput_output_len), "--random-range-ratio", str(args.range_ratio)]


def run_offline(args, engine_flags: list[str]) -> dict:
    out_json = os.path.join(args.out, "offline.json")
    log_path = os.path.join(args.out, "offline.log")
    if os.path.exists(out_json):
        os.remove(out_json)
    cmd = [sys.executable, *CLI, "bench", "throughput", *engine_flags, *throughput_flags(args),
           "--output-json", out_json, "--no-progress"]
    log(f"offline: {shlex.join(cmd)}")
    t0 = time.perf_counter()
    with open(log_path, "w") as f:
        try:
            proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=child_env(),
                                  timeout=min(args.offline_timeout, time_left(args)), start_new_session=True)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    wall = time.perf_counter() - t0
    print(tail(log_path, 800).rstrip(), flush=True)
    if rc != 0 or not os.path.exists(out_json):
        return {"error": f"bench throughput failed (rc {rc}):\n{tail(log_path)}", "process_wall_s": wall}
    with open(out_json) as f:
        res = json.load(f)
    res["process_wall_s"] = wall
    res["cmd"] = shlex.join(cmd)
    return res


def offline_warm_worker(args) -> None:
    """Fresh process: `bench throughput`'s own steps (same LLM flags, prompts, sampling params), after the
    server's warm-up bursts, so that first-call costs (Triton, cuBLAS, allocator) stay out of the timing."""
    from pagedllm import LLM, SamplingParams
    from pagedllm.entrypoints.bench import throughput as bench_thr
    from pagedllm.engine_args import EngineArgs

    p = argparse.ArgumentParser()
    bench_thr.add_cli_args(p)
    targs = p.parse_args(engine_flags_of(args) + throughput_flags(args))
    engine_args = EngineArgs.from_cli_args(targs)
    t0 = time.perf_counter()
    llm = LLM(**vars(engine_args))
    startup_s = time.perf_counter() - t0
    vocab = llm.llm_engine.config.model_config.vocab_size
    reqs = random_requests(targs.num_prompts, targs.input_len, targs.output_len, vocab, targs.random_range_ratio, targs.seed)
    warm = [random_requests(n, args.warmup_input_len, 8, vocab, 0.0, seed=args.seed + 1000 + i)
            for i, n in enumerate((1, 16, 17))]

    def generate(rs):
        params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=r.output_len) for r in rs]
        return llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in rs], params, use_tqdm=False)

    t0 = time.perf_counter()
    for rs in warm:
        generate(rs)
    warmup_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    outputs = generate(reqs)
    elapsed = time.perf_counter() - t0
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    num_in = sum(len(r.prompt_token_ids) for r in reqs)
    res = {"num_prompts": len(reqs), "elapsed_s": elapsed, "startup_s": startup_s, "warmup_s": warmup_s,
           "output_tokens_per_s": num_out / elapsed, "num_input_tokens": num_in, "num_output_tokens": num_out,
           "prompts_sha256": fingerprint(reqs)}
    print(f"warm offline: {res['output_tokens_per_s']:.2f} output tokens/s ({len(reqs)} prompts, {num_in} input + "
          f"{num_out} output tokens in {elapsed:.2f} s)", flush=True)
    with open(os.path.join(args.out, "offline_warm.json"), "w") as f:
        json.dump(res, f, indent=2)


def run_offline_warm(args) -> dict:
    out_json = os.path.join(args.out, "offline_warm.json")
    log_path = os.path.join(args.out, "offline_warm.log")
    if os.path.exists(out_json):
        os.remove(out_json)
    cmd = [sys.executable, os.path.abspath(__file__), "--offline-warm-worker", *args.argv]
    log(f"offline after warm-up: {shlex.join(cmd)}")
    t0 = time.perf_counter()
    with open(log_path, "w") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=child_env(),
                                timeout=min(args.offline_timeout, time_left(args)), start_new_session=True).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    wall = time.perf_counter() - t0
    print(tail(log_path, 300).rstrip(), flush=True)
    if rc != 0 or not os.path.exists(out_json):
        return {"error": f"warm offline run failed (rc {rc}):\n{tail(log_path)}", "process_wall_s": wall}
    with open(out_json) as f:
        res = json.load(f)
    res["process_wall_s"] = wall
    return res


# ---- report ----------------------------------------------------------------------------------------------
def _f(x, spec=".2f") -> str:
    return "n/a" if x is None else format(x, spec)


def verdict(ok) -> str:
    return "n/a" if ok is None else ("PASS" if ok else "FAIL")


def make_summary(args, res: dict) -> dict:
    a, b, off = res.get("latency") or {}, res.get("throughput") or {}, res.get("offline") or {}
    s: dict = {}
    if a:
        s["a_median_ttft_ms"] = a["ttft_ms"]["median"]
        s["a_median_itl_ms"] = a["itl_ms"]["median"]
        s["a_p99_ttft_ms"] = a["ttft_ms"]["p99"]
        s["a_p99_itl_ms"] = a["itl_ms"]["p99"]
        s["a_failed"] = a["failed"]
        s["a_ttft_ms_quantiles"] = a.get("ttft_ms_quantiles")
        s["a_server_side"] = a.get("server_side")
        s["a_ttft_ok"] = a["failed"] == 0 and s["a_median_ttft_ms"] <= args.ttft_target_ms
        s["a_itl_ok"] = a["failed"] == 0 and s["a_median_itl_ms"] <= args.itl_target_ms
    if b:
        s["b_served_output_tok_per_s"] = b["output_throughput"]
        s["b_failed"] = b["failed"]
        s["b_output_tokens_ok"] = b["total_output_tokens"] == b["requested_output_tokens"]
    if "output_tokens_per_s" in off:
        s["b_offline_output_tok_per_s"] = off["output_tokens_per_s"]
        s["offline_same_token_counts"] = (
            off["num_input_tokens"] == res["throughput_prompts"]["input_tokens"]
            and off["num_output_tokens"] == res["throughput_prompts"]["output_tokens"]
        )
    warm = res.get("offline_warm") or {}
    if "output_tokens_per_s" in warm:
        s["b_offline_warm_output_tok_per_s"] = warm["output_tokens_per_s"]
        s["offline_warm_same_prompts"] = warm["prompts_sha256"] == res["throughput_prompts"]["sha256"]
        if b:
            s["b_served_over_offline_warm"] = b["output_throughput"] / warm["output_tokens_per_s"]
    if b and "output_tokens_per_s" in off:
        s["b_served_over_offline"] = b["output_throughput"] / off["output_tokens_per_s"]
        s["b_ok"] = (b["failed"] == 0 and s["b_output_tokens_ok"] and s["offline_same_token_counts"]
                     and s["b_served_over_offline"] >= args.ratio_target)
    return s


def print_table(args, res: dict, s: dict) -> None:
    print()
    for key in ("error", "offline_error", "offline_warm_error"):
        if res.get(key):
            print(f"{key.upper()}: {res[key][-1500:]}")
    a_name = (f"(a) {args.latency_prompts} x {args.latency_input_len}/{args.latency_output_len} "
              f"@ {args.request_rate:g} req/s")
    b_name = (f"(b) {args.throughput_prompts} x {args.throughput_input_len}/{args.throughput_output_len} "
              f"@ inf, {args.throughput_prompts} streams")
    rows = [
        (f"{a_name}: median TTFT ms", _f(s.get("a_median_ttft_ms")), f"<= {args.ttft_target_ms:g}",
         verdict(s.get("a_ttft_ok"))),
        (f"{a_name}: median ITL ms", _f(s.get("a_median_itl_ms")), f"<= {args.itl_target_ms:g}",
         verdict(s.get("a_itl_ok"))),
        ("    p99 TTFT / p99 ITL ms", f"{_f(s.get('a_p99_ttft_ms'))} / {_f(s.get('a_p99_itl_ms'))}", "", ""),
        ("    TTFT p0 / p25 / p75 ms", " / ".join(_f((s.get("a_ttft_ms_quantiles") or {}).get(k), ".1f")
                                                for k in ("p0", "p25", "p75")), "", ""),
        ("    server: core queue / prefill / TTFT mean ms", " / ".join(
            _f((s.get("a_server_side") or {}).get(k), ".1f")
            for k in ("request_queue_time_seconds_mean_ms", "request_prefill_time_seconds_mean_ms",
                      "time_to_first_token_seconds_mean_ms")), "", ""),
        (f"{b_name}: served out tok/s", _f(s.get("b_served_output_tok_per_s"), ".1f"), "", ""),
        ("    bench throughput (offline, same prompts) out tok/s", _f(s.get("b_offline_output_tok_per_s"), ".1f"),
         "", ""),
        ("    served / offline", _f(s.get("b_served_over_offline"), ".3f"), f">= {args.ratio_target:g}",
         verdict(s.get("b_ok"))),
    ]
    if args.offline_warm:
        rows += [
            ("    offline after warm-up (info) out tok/s", _f(s.get("b_offline_warm_output_tok_per_s"), ".1f"), "", ""),
            ("    served / offline after warm-up (info)", _f(s.get("b_served_over_offline_warm"), ".3f"), "", ""),
        ]
    w = max(len(r[0]) for r in rows)
    print(f"{'metric':{w}s} {'measured':>15s} {'target':>9s} {'':>4s}")
    for name, val, target, ok in rows:
        print(f"{name:{w}s} {val:>15s} {target:>9s} {ok:>4s}")
    print(f"failed requests: (a) {s.get('a_failed', 'n/a')}, (b) {s.get('b_failed', 'n/a')}; "
          f"(b) served all requested tokens: {s.get('b_output_tokens_ok', 'n/a')}; "
          f"offline read/produced the same token counts: {s.get('offline_same_token_counts', 'n/a')}"
          + (f"; warm offline same prompts (sha256): {s.get('offline_warm_same_prompts', 'n/a')}" if args.offline_warm else ""))
    t = res.get("timings_s", {})
    print("wall s: " + ", ".join(f"{k} {v:.1f}" for k, v in t.items()))
    print(f"results: {os.path.join(args.out, 'h200_serve.json')}")


# ---- main ------------------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "h200_serve_out"))
    ap.add_argument("--model", default=LLAMA_8B)
    ap.add_argument("--tokenizer", required=True, help="tokenizer directory (the 8B shape directory has none)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--seed", type=int, default=0, help="engine seed and (b)'s prompt seed; (a) uses seed + 1")
    ap.add_argument("--extra-engine-args", default="", help="more engine flags for the server and the offline run")
    ap.add_argument("--request-rate", type=float, default=4.0, help="(a) Poisson arrival rate")
    ap.add_argument("--latency-prompts", type=int, default=120)
    ap.add_argument("--latency-input-len", type=int, default=1000)
    ap.add_argument("--latency-output-len", type=int, default=128)
    ap.add_argument("--throughput-prompts", type=int, default=256, help="(b): all sent at once, one stream each")
    ap.add_argument("--throughput-input-len", type=int, default=1000)
    ap.add_argument("--throughput-output-len", type=int, default=256)
    ap.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in mean * [1 - r, 1 + r]")
    ap.add_argument("--warmup-input-len", type=int, default=None, help="default: --latency-input-len")
    ap.add_argument("--no-warmup", action="store_true")
    ap.add_argument("--http-client", choices=("aiohttp", "httpx"), default=None,
                    help="the bench client's HTTP library (default: bench serve's, aiohttp when installed)")
    ap.add_argument("--latency-only", action="store_true", help="run (a) only: no (b), no offline runs")
    ap.add_argument("--ttft-target-ms", type=float, default=25.0)
    ap.add_argument("--itl-target-ms", type=float, default=6.0)
    ap.add_argument("--ratio-target", type=float, default=0.9)
    ap.add_argument("--offline-warm", action=argparse.BooleanOptionalAction, default=True,
                    help="also time the same offline run after the server's warm-up, in another fresh process")
    ap.add_argument("--offline-warm-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--budget-s", type=float, default=540.0,
                    help="wall budget for the whole run: phases time out at it, and what finished is reported")
    ap.add_argument("--server-start-timeout", type=float, default=300.0)
    ap.add_argument("--request-timeout", type=float, default=300.0)
    ap.add_argument("--offline-timeout", type=float, default=300.0)
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.out = os.path.abspath(args.out)
    args.model = os.path.abspath(args.model) if os.path.exists(args.model) else args.model
    if not os.path.isdir(args.tokenizer):
        ap.error(f"--tokenizer {args.tokenizer!r} is not a directory (e.g. .bench_assets/llama3)")
    args.tokenizer = os.path.abspath(args.tokenizer)
    if args.warmup_input_len is None:
        args.warmup_input_len = args.latency_input_len
    return args


class _LatencyOnly(Exception):
    """--latency-only: stop after (a)."""


def main(argv=None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    t_start = time.perf_counter()
    args.deadline = t_start + args.budget_s
    if args.offline_warm_worker:
        offline_warm_worker(args)
        return 0
    engine_flags = engine_flags_of(args)
    vocab = model_vocab_size(args.model, args.load_format)
    lat_reqs = random_requests(args.latency_prompts, args.latency_input_len, args.latency_output_len, vocab,
                               args.range_ratio, args.seed + 1)
    # Exactly what `pagedllm bench throughput` builds from the flags run_offline passes it.
    thr_reqs = random_requests(args.throughput_prompts, args.throughput_input_len, args.throughput_output_len, vocab,
                               args.range_ratio, args.seed)
    res: dict = {
        "config": {k: v for k, v in vars(args).items()},
        "engine_flags": engine_flags,
        "vocab_size": vocab,
        "throughput_prompts": {
            "sha256": fingerprint(thr_reqs),
            "input_tokens": sum(len(r.prompt_token_ids) for r in thr_reqs),
            "output_tokens": sum(r.output_len for r in thr_reqs),
        },
        "timings_s": {},
    }
    out_path = os.path.join(args.out, "h200_serve.json")

    def save() -> None:
        res["summary"] = make_summary(args, res)
        with open(out_path, "w") as f:
            json.dump(res, f, indent=2, default=str)

    timings = res["timings_s"]
    server = Server(["--served-model-name", "bench", "--disable-access-log", "--uvicorn-log-level", "warning",
                     *engine_flags], os.path.join(args.out, "server.log"))
    log(f"starting the server: {shlex.join(server.cmd)}")
    try:
        timings["server_start"] = server.wait_healthy(min(args.server_start_timeout, time_left(args)))
        log(f"server healthy after {timings['server_start']:.1f} s on {server.url}")
        if not args.no_warmup:
            res["warmup"] = warm_up(args, server.url, vocab)
            timings["warmup"] = res["warmup"]["warmup_s"]
        log(f"(a) {len(lat_reqs)} requests at {args.request_rate:g} req/s (Poisson)")
        t0 = time.perf_counter()
        before = scrape_histograms(server.url)
        res["latency"] = run_client(args, server.url, lat_reqs, args.request_rate, args.seed + 1)
        res["latency"]["server_side"] = histogram_means_ms(before, scrape_histograms(server.url))
        timings["a_latency"] = time.perf_counter() - t0
        save()
        if args.latency_only:
            raise _LatencyOnly
        log(f"(b) {len(thr_reqs)} requests at once ({len(thr_reqs)} streams)")
        t0 = time.perf_counter()
        res["throughput"] = run_client(args, server.url, thr_reqs, float("inf"), args.seed, len(thr_reqs))
        timings["b_throughput"] = time.perf_counter() - t0
        save()
    except _LatencyOnly:
        pass
    except Exception as e:  # noqa: BLE001 - keep going: stop the server, report what finished
        res["error"] = f"{type(e).__name__}: {e}"
        log(f"serving phase failed: {res['error'][:2000]}")
    finally:
        timings["server_stop"] = server.stop()
        log(f"server stopped in {timings['server_stop']:.1f} s (rc {server.proc.returncode})")
    res["server_log_tail"] = tail(server.log_path, 1500)
    save()
    if args.latency_only:
        print_table(args, res, res["summary"])
        return 0 if "error" not in res else 1

    t0 = time.perf_counter()
    res["offline"] = run_offline(args, engine_flags)
    timings["offline"] = time.perf_counter() - t0
    if "error" in res["offline"]:
        res["offline_error"] = res["offline"]["error"]
    if args.offline_warm and args.deadline - time.perf_counter() < 60:
        res["offline_warm"] = {"skipped": "less than 60 s of --budget-s left"}
    elif args.offline_warm:
        t0 = time.perf_counter()
        res["offline_warm"] = run_offline_warm(args)
        timings["offline_warm"] = time.perf_counter() - t0
        if "error" in res["offline_warm"]:
            res["offline_warm_error"] = res["offline_warm"]["error"]
    timings["total"] = time.perf_counter() - t_start
    save()
    print_table(args, res, res["summary"])
    return 0 if "error" not in res and "offline_error" not in res else 1


if __name__ == "__main__":
    sys.exit(main())
