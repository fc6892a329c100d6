"""How much of workload 1's decode attention time whole waves and long tails could cost: a scheduling model, no GPU.

Each decode step launches one program per (request, KV head), longest context first. When programs are
latency-bound (each streams at its own pace whatever else is resident, as the float8 one-warp launch
measured on an H200), a launch lasts as long as greedy list scheduling of those programs on the GPU's
resident slots takes. This script replays workload 1's decode steps (the same prompts as
``gpu_measure.workload_qwen``: 256 requests, in and out lengths uniform in [100, 1024]) through that
model and prints, per batch-size range, the launch time over the time of a perfectly balanced launch
(total context / slots). A ratio of 1.2 means splitting contexts into even pieces could save up to a
sixth of those launches. Bandwidth-bound launches (16-bit caches) lose less than this: there a
program speeds up when fewer are resident.

    python3 benchmarks/decode_waves.py [--programs-per-sm 8] [--sms 132] [--kv-heads 8] [--min-batch 99]
"""
from __future__ import annotations

import argparse
import heapq
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_measure import workload_qwen  # noqa: E402 - a sibling module: the workload's prompts

# Batch-size ranges reported; steps below --min-batch are left out (other launch shapes serve them).
RANGES = ((1, 64), (65, 128), (129, 192), (193, 256))


def launch_time(contexts: list[int], slots: int) -> float:
    """Time units until the last program ends: each program takes its context, longest first onto the
    first free slot."""
    free = [0.0] * min(slots, len(contexts))
    heapq.heapify(free)
    for length in sorted(contexts, reverse=True):
        heapq.heappush(free, heapq.heappop(free) + length)
    return max(free)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--programs-per-sm", type=int, default=8, help="resident programs per SM (float8 one warp: 8)")
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--min-batch", type=int, default=99, help="leave out smaller decode batches")
    args = ap.parse_args()
    slots = args.programs_per_sm * args.sms
    requests = [(len(prompt), out) for prompt, out in workload_qwen(151936)]
    totals: dict[tuple[int, int], list[float]] = {}
    for step in range(max(out for _, out in requests)):
        contexts = [inp + step for inp, out in requests if step < out]
        if len(contexts) < args.min_batch:
            continue
        programs = [c for c in contexts for _ in range(args.kv_heads)]
        rng = next(r for r in RANGES if r[0] <= len(contexts) <= r[1])
        row = totals.setdefault(rng, [0, 0.0, 0.0])
        row[0] += 1
        row[1] += launch_time(programs, slots)
        row[2] += sum(programs) / slots
    print(f"{slots} resident programs ({args.programs_per_sm} an SM), {args.kv_heads} KV heads, batches >= {args.min_batch}")
    for (lo, hi), (steps, actual, ideal) in sorted(totals.items()):
        print(f"  batch {max(lo, args.min_batch):3d}-{hi:3d}: {steps:4d} steps, launch / balanced {actual / ideal:.3f}")
    actual, ideal = sum(r[1] for r in totals.values()), sum(r[2] for r in totals.values())
    print(f"  all: launch / balanced {actual / ideal:.3f}")


if __name__ == "__main__":
    main()
