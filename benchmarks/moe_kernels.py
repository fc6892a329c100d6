"""The Triton fused MoE against a per-expert loop of cuBLAS products, with a sweep of its tile configs.

    PYTHONPATH=$PWD python3 benchmarks/moe_kernels.py [--tokens 1,16,256,4096] [--shapes qwen3-30b-a3b,mixtral-8x7b]
        [--sweep [--write]]

One MoE layer in bf16 with random weights and random routing (softmax top-k of random logits). Device µs
per call from CUDA-graph replay (median of 20): ``fused`` (``kernels.moe.fused_experts`` with the config
table's choice), ``loop`` (for each expert that received tokens: gather, gate/up product, SiLU-and-mul,
down product, weighted index_add; the routing is fixed beforehand so the loop captures into a graph), and
the floor: the bytes of the experts the step touches at the measured copy rate. ``--sweep`` also times a
grid of tile configs per token count and prints the best; ``--write`` also writes them as the device's tuned
table (``<device name>.json``) under ``--out``, the file that goes into ``pagedllm/kernels/moe/tuned/``, which
``kernels/moe/configs.py`` reads. Each result is checked against the reference first. Writes
``moe_kernels.json`` under ``$OUT``.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_measure import copy_bandwidth_bytes_per_s  # noqa: E402 - sibling scripts: the DEVICE.md copy rate
from linear_shapes import graph_time_us  # noqa: E402 - the same graph timing

from pagedllm.kernels.moe import fused_experts  # noqa: E402
from pagedllm.kernels.moe.configs import device_file_name, get_config, shape_key  # noqa: E402
from pagedllm.layers.fused_moe import fused_experts_ref, select_experts  # noqa: E402

# name -> (experts, top-k, hidden, expert intermediate)
SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "mixtral-8x7b": (8, 2, 4096, 14336)}


def _loop(x, w13, w2, weights, ids):
    """The per-expert loop with its routing resolved on the host once: a graph-capturable callable."""
    flat = ids.flatten().long()
    top_k = ids.shape[1]
    groups = []
    for e in torch.unique(flat).tolist():
        pairs = (flat == e).nonzero().flatten()
        groups.append((e, pairs // top_k, weights.flatten()[pairs].unsqueeze(-1).to(x.dtype)))
    out = torch.zeros_like(x)

    def run():
        out.zero_()
        for e, tokens, w in groups:
            gate, up = F.linear(x[tokens], w13[e]).chunk(2, dim=-1)
            out.index_add_(0, tokens, F.linear(F.silu(gate) * up, w2[e]) * w)
        return out

    return run, len(groups)


def _sweep_configs():
    for bm, bn, bk, warps, stages in itertools.product((16, 32, 64, 128), (64, 128), (64, 128), (4, 8), (3, 4)):
        yield dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8 if bm >= 64 else 1, num_warps=warps,
                   num_stages=stages)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1,16,256,4096")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--sweep", action="store_true", help="also time a grid of tile configs per token count")
    ap.add_argument("--write", action="store_true", help="with --sweep: write the best configs as the device's table")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    tbps = copy_bandwidth_bytes_per_s() / 1e12
    results = {"copy_tbps": tbps, "cases": []}
    tuned: dict[str, dict[str, dict]] = {}
    print(f"copy {tbps:.2f} TB/s (read + write)")
    for shape in args.shapes.split(","):
        num_experts, top_k, hidden, inter = SHAPES[shape]
        g = torch.Generator(device="cuda").manual_seed(0)
        w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=g, device="cuda") * hidden**-0.5).bfloat16()
        w2 = (torch.randn(num_experts, hidden, inter, generator=g, device="cuda") * inter**-0.5).bfloat16()
        for tokens in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(tokens, hidden, generator=g, device="cuda").bfloat16()
            weights, ids = select_experts(torch.randn(tokens, num_experts, generator=g, device="cuda"), top_k, True)
            ref = fused_experts_ref(x, w13, w2, weights, ids)
            got = fused_experts(x, w13, w2, weights, ids)
            torch.testing.assert_close(got.float(), ref.float(), atol=3e-2, rtol=3e-2)
            loop, touched = _loop(x, w13, w2, weights, ids)
            # The touched experts' bytes read once at the copy's traffic rate (read + write bytes per second).
            floor_us = touched * 3 * hidden * inter * 2 / (tbps * 1e12) * 1e6
            case = {"shape": shape, "tokens": tokens, "experts_touched": touched,
                    "config": get_config(tokens, top_k, num_experts, torch.bfloat16, shape=(inter, hidden)),
                    "fused_us": graph_time_us(lambda: fused_experts(x, w13, w2, weights, ids)),
                    "loop_us": graph_time_us(loop), "floor_us": floor_us}
            print(f"{shape:>14} {tokens:>5} tokens: fused {case['fused_us']:9.1f} µs  loop {case['loop_us']:9.1f} µs"
                  f"  floor {floor_us:8.1f} µs  ({touched} experts)")
            if args.sweep:
                timed = []
                for config in _sweep_configs():
                    try:
                        timed.append((graph_time_us(lambda: fused_experts(x, w13, w2, weights, ids, config)), config))
                    except Exception as e:  # a config past the device's shared memory fails to compile
                        print(f"    skipped {config}: {type(e).__name__}")
                best_us, best = min(timed, key=lambda t: t[0])
                torch.testing.assert_close(fused_experts(x, w13, w2, weights, ids, best).float(), ref.float(),
                                           atol=3e-2, rtol=3e-2)
                case["best_us"], case["best_config"] = best_us, best
                tuned.setdefault(shape_key(num_experts, inter, hidden), {})[str(tokens)] = best
                print(f"{'':>14} best {best_us:9.1f} µs  {best}  (rows per expert {tokens * top_k / num_experts:g})")
            results["cases"].append(case)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "moe_kernels.json"), "w") as f:
        json.dump(results, f, indent=1)
    if args.sweep and args.write:
        device = torch.cuda.get_device_name()
        with open(os.path.join(args.out, device_file_name(device)), "w") as f:
            json.dump({"device": device, "dtype": "bfloat16", "shapes": tuned}, f, indent=1)


if __name__ == "__main__":
    main()
