"""Time of one sampling step for the common request settings (greedy, temperature, top-k, top-p).

    PYTHONPATH=$PWD python3 benchmarks/sampler_paths.py [--out DIR]
    python benchmarks/sampler_paths.py --device cpu --batches 1,4,16 --vocabs 262144

Logits are random normal (std 3) in float32, [B, V]; on CUDA V is Qwen3's (151,936) and Llama 3's
(128,256) by default. Each case builds its SamplingMetadata once (host time reported apart) and times
``Sampler.forward``: on CUDA with events, median of 20 calls after 3 warm-up calls; on the CPU the mean
wall time of 3 calls after one. Compare with a decode step of the same batch (docs/performance.md).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

CASES = {
    "greedy": dict(temperature=0.0),
    "temperature 0.6": dict(temperature=0.6),
    "t 0.6, top_k 50": dict(temperature=0.6, top_k=50),
    "t 0.6, top_p 0.95": dict(temperature=0.6, top_p=0.95),
    "t 0.8, top_k 100, top_p 0.9": dict(temperature=0.8, top_k=100, top_p=0.9),
    "t 0.6, top_k 2000, top_p 0.95": dict(temperature=0.6, top_k=2000, top_p=0.95),
    "t 0.6, min_p 0.05": dict(temperature=0.6, min_p=0.05),
    "greedy, repetition 1.1": dict(temperature=0.0, repetition_penalty=1.1),
    "t 0.7, frequency 0.3, presence 0.5": dict(temperature=0.7, frequency_penalty=0.3, presence_penalty=0.5),
}


def _history(batch: int) -> tuple[list[list[int]], list[list[int]]]:
    """Each request's prompt (200 ids) and output so far (100 ids): what the penalties read."""
    return [list(range(200))] * batch, [[(i * 7 + j) % 5000 for j in range(100)] for i in range(batch)]


def time_case(batch: int, vocab: int, params_kw: dict, device: torch.device) -> dict:
    if device.type == "cpu":
        return _time_case_cpu(batch, vocab, params_kw)
    from pagedllm import SamplingParams
    from pagedllm.sample.metadata import build_sampling_metadata
    from pagedllm.sample.sampler import Sampler

    gen = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(batch, vocab, generator=gen, device=device) * 3.0
    params = [SamplingParams(**params_kw) for _ in range(batch)]
    t0 = time.perf_counter()
    md = build_sampling_metadata(params, *_history(batch), list(range(batch)), vocab, device)
    torch.cuda.synchronize()
    host_ms = 1e3 * (time.perf_counter() - t0)
    sampler = Sampler()
    for _ in range(3):
        sampler(logits, md)
    times = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        sampler(logits, md)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return {"device_ms": statistics.median(times), "metadata_host_ms": host_ms}


def _time_case_cpu(batch: int, vocab: int, params_kw: dict) -> dict:
    from pagedllm import SamplingParams
    from pagedllm.sample.metadata import build_sampling_metadata
    from pagedllm.sample.sampler import Sampler

    cpu = torch.device("cpu")
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(0)) * 3.0
    params = [SamplingParams(**params_kw) for _ in range(batch)]
    t0 = time.perf_counter()
    md = build_sampling_metadata(params, *_history(batch), list(range(batch)), vocab, cpu)
    host_ms = 1e3 * (time.perf_counter() - t0)
    sampler = Sampler()
    sampler(logits, md)
    t0 = time.perf_counter()
    for _ in range(3):
        sampler(logits, md)
    return {"device_ms": 1e3 * (time.perf_counter() - t0) / 3, "metadata_host_ms": host_ms}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--batches", default="64,256")
    ap.add_argument("--vocabs", default="151936,128256")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("sampler_paths: no CUDA device; nothing to time (--device cpu times the CPU paths)")
        return
    device = torch.device(args.device)
    rows = []
    print(f"{'case':36s} {'batch':>6s} {'vocab':>7s} {'sample ms':>10s} {'metadata host ms':>17s}")
    for vocab in (int(v) for v in args.vocabs.split(",")):
        for batch in (int(b) for b in args.batches.split(",")):
            for name, kw in CASES.items():
                r = time_case(batch, vocab, kw, device)
                rows.append({"case": name, "batch": batch, "vocab": vocab, **r})
                print(f"{name:36s} {batch:6d} {vocab:7d} {r['device_ms']:10.3f} {r['metadata_host_ms']:17.2f}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "sampler_paths.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
