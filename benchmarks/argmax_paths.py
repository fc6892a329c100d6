"""The greedy argmax over a decode batch's logits: torch's argmax, chunks in torch ops, and the Triton kernels.

    PYTHONPATH=$PWD python3 benchmarks/argmax_paths.py [--rows 1,16,64,256] [--vocabs 151936,128256]

bf16 logits (what the greedy path reads), device µs per call from CUDA-graph replay (median of 20),
each path checked against ``torch.argmax`` first. Also prints the time to read the logits once at the
measured copy rate, about the floor for any of them. Writes ``argmax_paths.json`` under ``$OUT``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from linear_shapes import copy_tbps, graph_time_us  # noqa: E402 - a sibling script: the same graph timing

from pagedllm.sample.argmax import argmax_rows  # noqa: E402
from pagedllm.kernels.sampling.argmax import argmax_rows_triton  # noqa: E402

PATHS = {
    "torch": lambda x: x.argmax(dim=-1),
    "chunks_torch": lambda x: argmax_rows(x, chunked=True),
    "triton": argmax_rows_triton,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,16,64,256")
    ap.add_argument("--vocabs", default="151936,128256")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    tbps = copy_tbps()
    results = {"copy_tbps": tbps, "cases": []}
    print(f"copy {tbps:.2f} TB/s (read + write)")
    print(f"{'vocab':>7} {'rows':>5} " + " ".join(f"{p:>13}" for p in PATHS) + "  read once")
    for vocab in (int(v) for v in args.vocabs.split(",")):
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, vocab, device="cuda").to(torch.bfloat16)
            expected = x.argmax(dim=-1)
            case = {"vocab": vocab, "rows": rows, "read_once_us": x.numel() * 2 / (tbps * 1e12) * 1e6}
            for name, fn in PATHS.items():
                assert torch.equal(fn(x), expected), name
                case[name] = graph_time_us(lambda fn=fn: fn(x))
            results["cases"].append(case)
            print(f"{vocab:>7} {rows:>5} " + " ".join(f"{case[p]:>10.1f} us" for p in PATHS)
                  + f"  {case['read_once_us']:.1f} us", flush=True)
    with open(os.path.join(args.out, "argmax_paths.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
