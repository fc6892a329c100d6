"""The Triton fused MoE against a per-expert loop of cuBLAS products, with a sweep of its tile configs.

    PYTHONPATH=$PWD python3 benchmarks/moe_kernels.py [--tokens 1 16 256 4096] [--shapes qwen3-30b-a3b,mixtral-8x7b]
        [--sweep [--write]] [--no-fp8] [--no-int4] [--no-int8] [--no-fp8-block]

One MoE layer in bf16 with random weights and random routing (softmax top-k of random logits). Device µs
per call from CUDA-graph replay (median of 20): ``fused`` (``kernels.moe.fused_experts`` with the config
table's choice), ``fused_fp8`` (the same kernel over the experts rounded to float8 rows, as ``--quantization
fp8`` stores them; checked against the reference over the dequantized experts), ``loop`` (for each expert that received tokens: gather, gate/up product, SiLU-and-mul,
down product, weighted index_add; the routing is fixed beforehand so the loop captures into a graph), and
the floor: the bytes of the experts the step touches at the measured copy rate. ``fused_w4`` runs the kernel over
the experts as 4-bit group-128 AWQ/GPTQ-style packed weights (random values; ``--no-int4`` skips it), against
``loop_w4``, the per-expert loop through the dense W4A16 kernel (``kernels/wna16.py``) that such experts ran
before they were stacked, and its floor (a quarter of the bf16 bytes plus the group scales and zero points).
``fused_i8`` runs it over the experts as W8A8 int8 rows (``--no-int8`` skips it), against ``loop_i8``, the per-expert
loop through the dense W8A8 product (``w8a8_linear``), and its floor (half the bf16 bytes). ``fused_fp8b`` runs it
over the experts as block-wise float8 (128x128 weight blocks, activations quantized per token and 128 inputs, as
Qwen3-FP8 checkpoints; ``--no-fp8-block`` skips it), against ``loop_fp8b``, the per-expert loop through the dense
block-float8 product (``fp8_block_linear``: the Triton kernel up to 64 rows, cuBLAS's block-scaled GEMM past them).
``--sweep`` also times a
grid of tile configs per token count and prints the best; ``--write`` also writes them as the device's tuned
table (``<device name>.json``) into ``pagedllm/kernels/moe/tuned/`` (which ``kernels/moe/configs.py`` reads)
and under ``--out``, merged into the table already there and rewritten after every token count, so a sweep
cut short keeps the counts it finished; ``--tokens`` limits a sweep to a few counts. Each result is checked
against the reference first. Writes ``moe_kernels.json`` under ``--out`` (default ``$OUT``), also after
every case.
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
from pagedllm.kernels.moe.grouped_gemm import BlockFp8ExpertWeights, Int8ExpertWeights, PackedExpertWeights  # noqa: E402
from pagedllm.kernels.wna16 import wna16_matmul  # noqa: E402
from pagedllm.kernels.moe.configs import TUNED_DIR, device_file_name, get_config, shape_key  # noqa: E402
from pagedllm.layers.fused_moe import fused_experts_ref, select_experts  # noqa: E402

# name -> (experts, top-k, hidden, expert intermediate)
SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "mixtral-8x7b": (8, 2, 4096, 14336)}


def _loop(x, w13, w2, weights, ids, product=None):
    """The per-expert loop with its routing resolved on the host once: a graph-capturable callable.
    ``product(rows, w, e)`` multiplies rows by expert e's projection in ``w`` (default: a bf16 ``F.linear``)."""
    product = product or (lambda a, w, e: F.linear(a, w[e]))
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
            gate, up = product(x[tokens], w13, e).chunk(2, dim=-1)
            out.index_add_(0, tokens, product(F.silu(gate) * up, w2, e) * w)
        return out

    return run, len(groups)


def _int4_experts(e: int, n: int, k: int, g: torch.Generator, group: int = 128):
    """Random 4-bit experts [E, N, K] in the packed layout, and the same experts dequantized to bf16."""
    from pagedllm.layers.quantization.wna16_layout import WNA16Weights

    qweight = torch.randint(-2**31, 2**31 - 1, (e, k // 8, n), generator=g, device="cuda", dtype=torch.int32)
    scales = (torch.rand(e, k // group, n, generator=g, device="cuda") * 2e-3 * k**-0.5 * 16).bfloat16()
    zeros = torch.randint(0, 16, (e, k // group, n), generator=g, device="cuda").float()
    packed = PackedExpertWeights(qweight, scales, zeros, None, 4, group)
    dense = torch.stack([WNA16Weights(qweight[i], scales[i], zeros[i], 4, group).dequantize() for i in range(e)])
    return packed, dense.bfloat16()


def _w4_product(a, w: PackedExpertWeights, e: int):
    """Expert e's projection through the dense W4A16 kernel, as one quantized linear per expert runs it."""
    return wna16_matmul(a, w.qweight[e], w.scales[e], w.zeros[e], w.bits, w.group_size, None)


def _int8_experts(w: torch.Tensor) -> Int8ExpertWeights:  # [E, N, K] -> int8 rows with a scale each
    from pagedllm.layers.quantization.int8 import quantize_int8_rows

    q, s, _ = quantize_int8_rows(w.flatten(0, 1))
    return Int8ExpertWeights(q.view(w.shape), s.view(w.shape[:2]))


def _i8_product(a, w: Int8ExpertWeights, e: int):
    """Expert e's projection through the dense W8A8 product, as one W8A8 linear per expert runs it."""
    from pagedllm.layers.quantization.int8 import w8a8_linear

    return w8a8_linear(a, w.weight[e], w.scale[e][:, None], None, True)


def _block_fp8_experts(w: torch.Tensor, block: int = 128) -> BlockFp8ExpertWeights:  # [E, N, K] bf16
    """Float8 experts with a float32 scale per 128x128 block (the block's largest magnitude maps to 448)."""
    e, n, k = w.shape
    blocks = w.float().view(e, n // block, block, k // block, block)
    scale = (blocks.abs().amax(dim=(2, 4)) / 448.0).clamp_min(1e-12)  # [E, N / 128, K / 128]
    q = (blocks / scale[:, :, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(e, n, k)
    return BlockFp8ExpertWeights(q, scale.contiguous(), (block, block))


def _fp8b_product(a, w: BlockFp8ExpertWeights, e: int):
    """Expert e's projection through the dense block-float8 product, as one block-wise float8 linear runs it."""
    from pagedllm.kernels.fp8_block import fp8_block_linear

    return fp8_block_linear(a, w.weight[e], w.scale[e], w.block, w.block[1])


def _sweep_configs():
    for bm, bn, bk, warps, stages in itertools.product((16, 32, 64, 128), (64, 128), (64, 128), (4, 8), (3, 4)):
        yield dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8 if bm >= 64 else 1, num_warps=warps,
                   num_stages=stages)


def _fp8_experts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [E, N, K] -> float8 [E, N, K], [E, N]
    """Float8 rows with a float32 scale per expert and output row, as ``MoEExperts.quantize_fp8`` makes them."""
    from pagedllm.layers.quantization.fp8 import quantize_rows_ref

    q, s = zip(*(quantize_rows_ref(w[e]) for e in range(w.shape[0])))
    return torch.stack(q), torch.stack(s).squeeze(-1).contiguous()


def parse_tokens(values: list[str]) -> list[int]:
    """``["1", "16,256"]`` -> ``[1, 16, 256]``: counts given space- or comma-separated, each at least 1."""
    out = []
    for v in values:
        for t in (t for t in v.split(",") if t):
            if not t.isdigit() or int(t) < 1:
                raise SystemExit(f"--tokens: {t!r} is not a whole number >= 1")
            out.append(int(t))
    return out


def write_tuned(tuned: dict[str, dict[str, dict]], device: str, dirs: list[str]) -> list[str]:
    """Merges ``tuned`` ({shape key: {tokens: config}}) into the device's table as ``dirs[0]`` holds it (its
    shapes and counts not swept now kept) and writes the result to each of ``dirs``; returns the paths."""
    name = device_file_name(device)
    table = {"device": device, "dtype": "bfloat16", "shapes": {}}
    if os.path.exists(os.path.join(dirs[0], name)):
        with open(os.path.join(dirs[0], name)) as f:
            table = json.load(f)
    for key, rows in tuned.items():
        table["shapes"].setdefault(key, {}).update(rows)
    paths = []
    for d in dict.fromkeys(os.path.abspath(d) for d in dirs):
        os.makedirs(d, exist_ok=True)
        path = os.path.join(d, name)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(table, f, indent=1, sort_keys=True)
        os.replace(tmp, path)  # whole or not at all: a run killed mid-write leaves the previous table
        paths.append(path)
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", nargs="+", default=["1,16,256,4096"],
                    help="token counts, space- or comma-separated (e.g. --tokens 1 16 256)")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--sweep", action="store_true", help="also time a grid of tile configs per token count")
    ap.add_argument("--write", action="store_true", help="with --sweep: write the best configs as the device's table")
    ap.add_argument("--tuned-dir", default=TUNED_DIR, help="with --write: where the package's tables live")
    ap.add_argument("--no-fp8", action="store_true", help="skip the float8-experts timing")
    ap.add_argument("--no-int4", action="store_true", help="skip the 4-bit packed experts timing")
    ap.add_argument("--no-int8", action="store_true", help="skip the W8A8 int8 experts timing")
    ap.add_argument("--no-fp8-block", action="store_true", help="skip the block-wise float8 experts timing")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    token_counts = parse_tokens(args.tokens)
    unknown = [s for s in args.shapes.split(",") if s not in SHAPES]
    if unknown:
        raise SystemExit(f"--shapes: unknown {unknown}; known: {', '.join(SHAPES)}")
    os.makedirs(args.out, exist_ok=True)
    device = torch.cuda.get_device_name()
    tbps = copy_bandwidth_bytes_per_s() / 1e12
    results = {"copy_tbps": tbps, "cases": []}
    tuned: dict[str, dict[str, dict]] = {}
    print(f"copy {tbps:.2f} TB/s (read + write)")
    for shape in args.shapes.split(","):
        num_experts, top_k, hidden, inter = SHAPES[shape]
        g = torch.Generator(device="cuda").manual_seed(0)
        w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=g, device="cuda") * hidden**-0.5).bfloat16()
        w2 = (torch.randn(num_experts, hidden, inter, generator=g, device="cuda") * inter**-0.5).bfloat16()
        w13_q = w2_q = None
        if not args.no_fp8:
            (w13_q, w13_s), (w2_q, w2_s) = _fp8_experts(w13), _fp8_experts(w2)
        if not args.no_int4:
            (p13, d13), (p2, d2) = _int4_experts(num_experts, 2 * inter, hidden, g), _int4_experts(num_experts, hidden, inter, g)
        if not args.no_int8:
            i13, i2 = _int8_experts(w13), _int8_experts(w2)
        if not args.no_fp8_block:
            b13, b2 = _block_fp8_experts(w13), _block_fp8_experts(w2)
        for tokens in token_counts:
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
            fp8_note = ""
            if w13_q is not None:
                fp8 = lambda: fused_experts(x, w13_q, w2_q, weights, ids, w13_scale=w13_s, w2_scale=w2_s)  # noqa: E731
                ref8 = fused_experts_ref(x.float(), w13_q, w2_q, weights, ids, "silu", w13_s, w2_s)
                torch.testing.assert_close(fp8().float(), ref8, atol=3e-2, rtol=3e-2)
                case["fused_fp8_us"] = graph_time_us(fp8)
                case["floor_fp8_us"] = floor_us / 2  # one byte a weight
                fp8_note = f"  fused fp8 {case['fused_fp8_us']:9.1f} µs (floor {floor_us / 2:8.1f})"
            int4_note = ""
            if not args.no_int4:
                w4 = lambda: fused_experts(x, p13, p2, weights, ids)  # noqa: E731
                torch.testing.assert_close(w4().float(), fused_experts_ref(x.float(), d13.float(), d2.float(), weights,
                                                                           ids), atol=3e-2, rtol=3e-2)
                case["fused_w4_us"] = graph_time_us(w4)
                case["loop_w4_us"] = graph_time_us(_loop(x, p13, p2, weights, ids, _w4_product)[0])
                # half a byte a weight, a bf16 scale and a float32 zero point a group of 128
                case["floor_w4_us"] = floor_us / 4 * (1 + 12 / 128)
                int4_note = (f"  fused w4 {case['fused_w4_us']:9.1f} µs  loop w4 {case['loop_w4_us']:9.1f} µs "
                             f"(floor {case['floor_w4_us']:8.1f})")
            int8_note = ""
            if not args.no_int8:
                i8 = lambda: fused_experts(x, i13, i2, weights, ids)  # noqa: E731
                loop_i8 = _loop(x, i13, i2, weights, ids, _i8_product)[0]
                torch.testing.assert_close(i8().float(), loop_i8().float(), atol=3e-2, rtol=3e-2)
                case["fused_i8_us"], case["loop_i8_us"] = graph_time_us(i8), graph_time_us(loop_i8)
                case["floor_i8_us"] = floor_us / 2  # one byte a weight
                int8_note = (f"  fused i8 {case['fused_i8_us']:9.1f} µs  loop i8 {case['loop_i8_us']:9.1f} µs "
                             f"(floor {floor_us / 2:8.1f})")
            fp8b_note = ""
            if not args.no_fp8_block:
                fb = lambda: fused_experts(x, b13, b2, weights, ids)  # noqa: E731
                loop_fb = _loop(x, b13, b2, weights, ids, _fp8b_product)[0]
                torch.testing.assert_close(fb().float(), loop_fb().float(), atol=3e-2, rtol=3e-2)
                case["fused_fp8b_us"], case["loop_fp8b_us"] = graph_time_us(fb), graph_time_us(loop_fb)
                fp8b_note = f"  fused fp8b {case['fused_fp8b_us']:9.1f} µs  loop fp8b {case['loop_fp8b_us']:9.1f} µs"
            print(f"{shape:>14} {tokens:>5} tokens: fused {case['fused_us']:9.1f} µs  loop {case['loop_us']:9.1f} µs"
                  f"  floor {floor_us:8.1f} µs  ({touched} experts){fp8_note}{int4_note}{int8_note}{fp8b_note}",
                  flush=True)
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
                if args.write:
                    written = write_tuned(tuned, device, [args.tuned_dir, args.out])
                    print(f"{'':>14} tuned table: {', '.join(written)}", flush=True)
            results["cases"].append(case)
            with open(os.path.join(args.out, "moe_kernels.json"), "w") as f:
                json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
