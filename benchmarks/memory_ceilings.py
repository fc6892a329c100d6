"""The device's memory ceilings that decode kernels are judged against: copy (read + write) and read-only rates.

    python3 benchmarks/memory_ceilings.py [--gib 8]

Decode attention only reads (the KV cache) and writes almost nothing, so its ceiling is the read-only
rate, which can differ from the copy rate quoted elsewhere. Three readers are timed over a buffer far
larger than L2: ``torch.sum``, and a Triton kernel that streams the buffer in tiles, in a sweep of tile
sizes and grid shapes (one program a tile, or a persistent grid of a few programs per SM). Each figure
is the median of 20 CUDA-event-timed calls.
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import triton
import triton.language as tl
from gpu_measure import median_event_ms


@triton.jit
def _read_kernel(x_ptr, out_ptr, n_tiles, BLOCK: tl.constexpr, TILES_PER_PROG: tl.constexpr):
    # Each program sums TILES_PER_PROG tiles strided by the grid; one float per program is written.
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    offs = tl.arange(0, BLOCK)
    for i in range(TILES_PER_PROG):
        tile = pid + i * nprog
        m = tile < n_tiles
        x = tl.load(x_ptr + tile.to(tl.int64) * BLOCK + offs, mask=m & (offs < BLOCK), other=0.0)
        acc += x.to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gib", type=float, default=8.0, help="buffer size in GiB")
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "memory_ceilings.json"))
    args = ap.parse_args()
    n = int(args.gib * 2**30) // 2
    x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    nbytes = x.numel() * x.element_size()
    rows = []

    def record(name: str, ms: float, moved: int) -> None:
        rate = moved / ms / 1e9
        rows.append({"reader": name, "ms": ms, "tb_per_s": rate})
        print(f"{name:44s} {ms:8.3f} ms  {rate:6.2f} TB/s", flush=True)

    record("copy (read + write bytes)", median_event_ms(lambda: y.copy_(x)), 2 * nbytes)
    record("torch.sum (read)", median_event_ms(lambda: x.sum(dtype=torch.float32)), nbytes)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = torch.empty(1 << 22, device="cuda", dtype=torch.float32)
    for block in (2048, 4096, 8192):
        n_tiles = n // block
        for warps in (4, 8):
            for per_sm in (0, 4, 8, 16):
                grid = n_tiles if per_sm == 0 else sms * per_sm
                tiles_per_prog = triton.cdiv(n_tiles, grid)
                if grid > out.numel():
                    continue
                fn = lambda: _read_kernel[(grid,)](x, out, n_tiles, BLOCK=block, TILES_PER_PROG=tiles_per_prog,
                                                   num_warps=warps)
                label = f"triton read: tile {block}, {warps} warps, " + ("1 tile/prog" if per_sm == 0 else f"{per_sm}/SM")
                record(label, median_event_ms(fn), n_tiles * block * 2)
    best = max(rows[1:], key=lambda r: r["tb_per_s"])
    print(f"\nbest read-only: {best['tb_per_s']:.2f} TB/s ({best['reader']}); copy {rows[0]['tb_per_s']:.2f} TB/s "
          f"(read-only / copy = {best['tb_per_s'] / rows[0]['tb_per_s']:.3f})")
    with open(args.json, "w") as f:
        json.dump({"gib": args.gib, "rows": rows, "best_read": best}, f, indent=1)


if __name__ == "__main__":
    main()
