"""Tile sweep of the top-k/top-p threshold kernel (kernels/sampling/top_p.py) on CUDA, checked against the full sort.

    PYTHONPATH=$PWD python3 benchmarks/top_p_kernel.py [--rows 64,256] [--vocab 151936]

For each (tokens per program, warps) the whole truncation (``top_k_top_p_triton_``) is timed on random
float32 logits (normal, std 3, temperature 0.6 applied), top_p 0.95 alone and top_k 2000 with it;
device time, median of 20 calls. Each setting's kept set must equal the sorted reference's.
"""
from __future__ import annotations

import argparse
import json
import os

import torch

from pagedllm.kernels.sampling import top_p as top_p_triton
from pagedllm.sample.truncation import sorted_threshold_
from gpu_measure import median_event_ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", default="64,256")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--chunks", default="2048,4096,8192")
    ap.add_argument("--warps", default="4,8,16")
    ap.add_argument("--compare", default="", help="module name of another implementation to time beside it")
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "top_p_kernel.json"))
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows_out = []
    for rows in (int(r) for r in args.rows.split(",")):
        logits = torch.randn(rows, args.vocab, device="cuda", generator=gen) * 3.0 / 0.6
        top_p = torch.full((rows,), 0.95, device="cuda")
        cases = {"top_p 0.95": None, "top_k 2000 + top_p 0.95": torch.full((rows,), 2000, device="cuda")}
        for name, top_k in cases.items():
            ref = logits.clone()
            threshold = sorted_threshold_(ref, top_k, top_p)
            ref_kept = ref >= threshold
            if args.compare:
                import importlib

                other = importlib.import_module(args.compare)
                for _ in range(2):
                    ms_o = median_event_ms(lambda: other.top_k_top_p_triton_(logits.clone(), top_k, top_p))
                    ms_n = median_event_ms(lambda: top_p_triton.top_k_top_p_triton_(logits.clone(), top_k, top_p))
                    print(f"{rows:4d} {name:24s} {args.compare}: {ms_o:6.3f} ms | this one: {ms_n:6.3f} ms", flush=True)
            for chunk in (int(c) for c in args.chunks.split(",")):
                for warps in (int(w) for w in args.warps.split(",")):
                    top_p_triton._CHUNK, top_p_triton._WARPS = chunk, warps
                    work = logits.clone()
                    kept = top_p_triton.top_k_top_p_triton_(work, top_k, top_p) > float("-inf")
                    differ = int((kept != ref_kept).sum())
                    ms = median_event_ms(lambda: top_p_triton.top_k_top_p_triton_(logits.clone(), top_k, top_p))
                    copy_ms = median_event_ms(lambda: logits.clone())
                    print(f"{rows:4d} x {args.vocab} {name:24s} chunk {chunk:5d} warps {warps:2d}: "
                          f"{ms - copy_ms:6.3f} ms  (tokens differing from the sort: {differ})", flush=True)
                    rows_out.append({"rows": rows, "case": name, "chunk": chunk, "warps": warps,
                                     "ms": ms - copy_ms, "differ": differ})
    with open(args.json, "w") as f:
        json.dump(rows_out, f, indent=1)


if __name__ == "__main__":
    main()
