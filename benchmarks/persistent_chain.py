"""What a decode layer's four products cost inside one persistent kernel, against cuBLAS launches in a CUDA graph.

A decode step of a small model is ~112 products that each take 5-8 µs in a chain of launches while
their weight bytes need 0.5-3 µs (``product_chain.py``). This asks how much of the rest a persistent
kernel would win back: one launch of one program per SM (or two) runs every layer's products in
order, with a grid-wide barrier (an atomic counter) where one product needs the last one's output.

Per layer, with the real shapes of the model and no attention (its stand-in is the query columns),
n(x) an RMSNorm with a unit weight:

    qkv = n(x) @ Wqkv^T;  x += qkv[:, :q] @ Wo^T;  h = silu(n(x) @ Wg^T) * (n(x) @ Wu^T);  x += h @ Wd^T

The kernel has no norm pass: a normalised product streams whole rows of x anyway, so it sums their
squares on the way and scales its output rows at the end.

Each product is cut into items of ``block_n`` weight rows (by ``split`` pieces of the input
dimension); each program takes every G-th item. A split item stores a float32 partial and the last of
its tile to arrive (an atomic count) adds them in split order and the residual, so the bits do not
depend on arrival order. Variants, each checked against the same chain in torch first (``full``):

- ``full``: barriers and products; ``prefetch``: the same, each program first asking L2 for its next
  product's weight slice (Hopper's bulk prefetch);
- ``nosync``: products without barriers (wrong values, timed only: the products' own floor);
- ``synconly``: barriers only (what the 4 x layers grid barriers cost).

Beside them, the same layers as the engine launches them (cuBLAS products, its fused residual-add +
RMSNorm and act·mul kernels) and the products alone through cuBLAS.

    python3 benchmarks/persistent_chain.py [--model qwen|llama] [--rows 16,32,64,128,256] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

# Decoder shapes: hidden, qkv outputs, query width (the attention stand-in), MLP width, layers.
SHAPES = {"qwen": (1024, 4096, 2048, 3072, 28), "llama": (4096, 6144, 4096, 14336, 32)}
# A barrier that waits longer (~1 s) reports it (err) instead of hanging the device; the host checks
# beforehand that every program can be resident at once (``resident_programs``).
SPIN_LIMIT = tl.constexpr(1 << 20)


class ChainConfig(NamedTuple):
    programs: int  # persistent programs (all resident at once)
    bn: tuple  # weight rows per item: qkv, o, gate_up (pairs), down
    split: tuple  # input-dimension pieces per item, the same order
    block_k: int = 128
    num_warps: int = 4


@triton.jit
def _grid_sync(sync_ptr, err_ptr, target):
    """Wait until every program has arrived here ``target // programs`` times (the count only grows)."""
    # Every thread's stores precede the arrival (the CTA barrier, then a release at GPU scope), and
    # every later load follows the acquire that saw the last arrival.
    tl.debug_barrier()
    seen = tl.atomic_add(sync_ptr, 1, sem="release", scope="gpu") + 1
    spins = 0
    while (seen < target) & (spins < SPIN_LIMIT):
        seen = tl.atomic_add(sync_ptr, 0, sem="acquire", scope="gpu")
        spins += 1
    if spins >= SPIN_LIMIT:
        tl.atomic_xchg(err_ptr, 1, sem="relaxed", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _after_product(SYNC: tl.constexpr, sync_ptr, err_ptr, arrivals, G):
    """With SYNC, the grid barrier that ends a product: returns the arrivals counted so far."""
    if SYNC:
        arrivals += G
        _grid_sync(sync_ptr, err_ptr, arrivals)
    return arrivals


@triton.jit
def _prefetch_items(w_ptr, stride_w, pid, G, K, N: tl.constexpr, BN: tl.constexpr, SPLIT: tl.constexpr,
                    PAIRS: tl.constexpr):
    """Ask L2 for this program's weight rows of a coming product (whole rows: a split item's pieces
    are fetched by its first piece's program only)."""
    for item in range(pid, (N // BN) * SPLIT, G):
        if item % SPLIT == 0:
            first = w_ptr + (item // SPLIT) * BN * stride_w
            _bulk_prefetch(first, BN * K * 2)
            if PAIRS:
                _bulk_prefetch(first + N * stride_w, BN * K * 2)


@triton.jit
def _bulk_prefetch(ptr, nbytes):
    tl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .b32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [ptr.to(tl.int64, bitcast=True), nbytes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _product(x_ptr, stride_x, w_ptr, stride_w, y_ptr, stride_y, part_ptr, count_ptr, M, K, pid, G,
             N: tl.constexpr, BN: tl.constexpr, SPLIT: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
             EPI: tl.constexpr, NORM: tl.constexpr = False):
    """y = x @ W^T over this program's items. EPI 0: store; 1: y += (the residual); 2: W holds N gate
    rows then N up rows and y = silu(gate) * up. NORM (SPLIT 1): x is first RMS-normalised per row (unit
    weight): every item streams whole rows of x, so it sums their squares on the way and scales its
    output rows at the end, and no separate norm pass exists."""
    k_len = K // SPLIT
    rows = tl.arange(0, BM)  # [BM]
    row_in = rows < M
    for item in range(pid, (N // BN) * SPLIT, G):
        tile = item // SPLIT
        piece = item % SPLIT
        cols = tile * BN + tl.arange(0, BN)  # [BN]
        ks = piece * k_len + tl.arange(0, BK)  # [BK]
        w_ptrs = w_ptr + cols.to(tl.int64)[:, None] * stride_w + ks[None, :]  # [BN, BK]
        x_ptrs = x_ptr + rows[None, :] * stride_x + ks[:, None]  # [BK, BM]: x^T
        acc = tl.zeros([BN, BM], dtype=tl.float32)  # out^T: weight rows on the tensor cores' long side
        acc2 = tl.zeros([BN, BM], dtype=tl.float32)
        squares = tl.zeros([BM], dtype=tl.float32)
        for k0 in range(0, k_len, BK):
            # Activations were written by other programs: read them from L2, never from this SM's L1.
            xt = tl.load(x_ptrs + k0, mask=row_in[None, :], other=0.0, cache_modifier=".cg")
            acc = tl.dot(tl.load(w_ptrs + k0), xt, acc)
            if EPI == 2:
                acc2 = tl.dot(tl.load(w_ptrs + N * stride_w + k0), xt, acc2)
            if NORM:
                xf = xt.to(tl.float32)
                squares += tl.sum(xf * xf, axis=0)
        if NORM:
            rstd = tl.rsqrt(squares / K + 1e-6)
            acc *= rstd[None, :]
            acc2 *= rstd[None, :]
        y_ptrs = y_ptr + rows[None, :] * stride_y + cols[:, None]  # [BN, BM]
        if SPLIT > 1:
            part = part_ptr + (cols[:, None] * BM + rows[None, :])  # [BN, BM] of piece 0
            tl.store(part + piece * N * BM, acc)
            if EPI == 2:
                tl.store(part + (SPLIT + piece) * N * BM, acc2)
            tl.debug_barrier()
            arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
            last = arrived == SPLIT - 1
            if last:
                tl.debug_barrier()
                acc = tl.zeros([BN, BM], dtype=tl.float32)
                acc2 = tl.zeros([BN, BM], dtype=tl.float32)
                for s in tl.static_range(SPLIT):
                    acc += tl.load(part + s * N * BM, cache_modifier=".cg")
                    if EPI == 2:
                        acc2 += tl.load(part + (SPLIT + s) * N * BM, cache_modifier=".cg")
                tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")
        else:
            last = True
        if last:
            if EPI == 1:
                acc += tl.load(y_ptrs, mask=row_in[None, :], other=0.0, cache_modifier=".cg").to(tl.float32)
            if EPI == 2:
                acc = acc / (1.0 + tl.exp(-acc)) * acc2
            tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_in[None, :])


@triton.jit
def _chain_kernel(
    x_ptr,  # [M, H] the residual stream, read and updated in place
    qkv_ptr,  # [M, NQKV] scratch
    h_ptr,  # [M, NI] scratch
    wqkv_ptr,  # [layers, NQKV, H]
    wo_ptr,  # [layers, H, NQ]
    wgu_ptr,  # [layers, 2 * NI, H]: gate rows, then up rows
    wd_ptr,  # [layers, H, NI]
    part_ptr,  # float32 split partials, [2 * max split, max N, BM]
    count_ptr,  # int32 arrivals per output tile, zero on entry and exit
    sync_ptr,  # int32 barrier count, zero on entry
    err_ptr,  # int32, set when a barrier gave up waiting
    M, layers,
    H: tl.constexpr, NQKV: tl.constexpr, NQ: tl.constexpr, NI: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
    BN1: tl.constexpr, BN2: tl.constexpr, BN3: tl.constexpr, BN4: tl.constexpr,
    S1: tl.constexpr, S2: tl.constexpr, S3: tl.constexpr, S4: tl.constexpr,
    SYNC: tl.constexpr, WORK: tl.constexpr, PREFETCH: tl.constexpr,
):
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    arrivals = pid * 0
    for layer in range(layers):
        at = tl.cast(layer, tl.int64)
        wqkv = wqkv_ptr + at * NQKV * H
        wo = wo_ptr + at * H * NQ
        wgu = wgu_ptr + at * 2 * NI * H
        wd = wd_ptr + at * H * NI
        # Each product first asks L2 for the next one's weights, a product ahead of their use.
        if PREFETCH:
            _prefetch_items(wo, NQ, pid, G, NQ, H, BN2, S2, False)
        if WORK:
            _product(x_ptr, H, wqkv, H, qkv_ptr, NQKV, part_ptr, count_ptr, M, H, pid, G, NQKV, BN1, S1, BM, BK, 0, True)
        arrivals = _after_product(SYNC, sync_ptr, err_ptr, arrivals, G)
        if PREFETCH:
            _prefetch_items(wgu, H, pid, G, H, NI, BN3, S3, True)
        if WORK:
            _product(qkv_ptr, NQKV, wo, NQ, x_ptr, H, part_ptr, count_ptr, M, NQ, pid, G, H, BN2, S2, BM, BK, 1)
        arrivals = _after_product(SYNC, sync_ptr, err_ptr, arrivals, G)
        if PREFETCH:
            _prefetch_items(wd, NI, pid, G, NI, H, BN4, S4, False)
        if WORK:
            _product(x_ptr, H, wgu, H, h_ptr, NI, part_ptr, count_ptr, M, H, pid, G, NI, BN3, S3, BM, BK, 2, True)
        arrivals = _after_product(SYNC, sync_ptr, err_ptr, arrivals, G)
        if PREFETCH:
            if layer + 1 < layers:
                _prefetch_items(wqkv + NQKV * H, H, pid, G, H, NQKV, BN1, S1, False)
        if WORK:
            _product(h_ptr, NI, wd, NI, x_ptr, H, part_ptr, count_ptr, M, NI, pid, G, H, BN4, S4, BM, BK, 1)
        arrivals = _after_product(SYNC, sync_ptr, err_ptr, arrivals, G)


class Chain:
    """The weights, activations and scratch of one chain, and its launch."""

    def __init__(self, model: str, rows: int, dtype=torch.bfloat16, device="cuda", shapes=None, seed=0):
        self.h, self.nqkv, self.nq, self.ni, self.layers = shapes or SHAPES[model]
        g = torch.Generator(device="cpu").manual_seed(seed)

        def weight(n: int, k: int) -> torch.Tensor:
            w = torch.randn(self.layers, n, k, generator=g) / k**0.5
            return w.to(dtype=dtype, device=device)

        self.wqkv = weight(self.nqkv, self.h)
        self.wo = weight(self.h, self.nq)
        self.wgu = weight(2 * self.ni, self.h)
        self.wd = weight(self.h, self.ni)
        self.rows = rows
        self.bm = max(16, triton.next_power_of_2(rows))
        self.x0 = torch.randn(rows, self.h, generator=g).to(dtype=dtype, device=device)
        self.x = self.x0.clone()
        self.qkv = torch.empty(rows, self.nqkv, dtype=dtype, device=device)
        self.hid = torch.empty(rows, self.ni, dtype=dtype, device=device)
        max_n = max(self.nqkv, self.h, self.ni)
        self.part = torch.empty(2 * 8 * max_n * self.bm, dtype=torch.float32, device=device)
        self.count = torch.zeros(max_n, dtype=torch.int32, device=device)
        self.sync = torch.zeros(1, dtype=torch.int32, device=device)
        self.err = torch.zeros(1, dtype=torch.int32, device=device)

    def check_config(self, cfg: ChainConfig) -> None:
        for n, k, bn, s in zip((self.nqkv, self.h, self.ni, self.h), (self.h, self.nq, self.h, self.ni), cfg.bn, cfg.split):
            if n % bn or k % (s * cfg.block_k) or s > 8:
                raise ValueError(f"config {cfg}: {n} rows by {bn}, input {k} by {s} x {cfg.block_k}")
        if cfg.split[0] > 1 or cfg.split[2] > 1:
            raise ValueError(f"config {cfg}: the normalised products (qkv, gate_up) take whole input rows (split 1)")

    def launch(self, cfg: ChainConfig, sync=True, work=True, prefetch=False, programs: int = 0):
        """Run the chain from x0; ``programs`` overrides the grid (1 runs everything in one program)."""
        self.x.copy_(self.x0)
        self.sync.zero_()
        self.count.zero_()  # a ``nosync`` launch may leave counts behind (arrivals of two products mixed)
        return _chain_kernel[(programs or cfg.programs,)](
            self.x, self.qkv, self.hid, self.wqkv, self.wo, self.wgu, self.wd, self.part, self.count, self.sync,
            self.err, self.rows, self.layers, self.h, self.nqkv, self.nq, self.ni, self.bm, cfg.block_k, *cfg.bn,
            *cfg.split, sync, work, prefetch, num_warps=cfg.num_warps, num_stages=3)

    def reference(self) -> torch.Tensor:
        """The same chain in torch, one op at a time: [rows, H]."""
        x = self.x0.clone()
        for layer in range(self.layers):
            qkv = F.linear(rms_norm(x), self.wqkv[layer])
            x = x + F.linear(qkv[:, :self.nq], self.wo[layer])
            gu = F.linear(rms_norm(x), self.wgu[layer])
            x = x + F.linear(F.silu(gu[:, :self.ni]) * gu[:, self.ni:], self.wd[layer])
        return x

    def engine_chain(self):
        """A callable replaying the chain as the engine launches a layer: cuBLAS products, its fused
        residual-add + RMSNorm and act·mul Triton kernels (under PDL on Hopper)."""
        from pagedllm.layers.kernels.activation import act_and_mul
        from pagedllm.layers.kernels.rmsnorm import rms_norm as fused_norm

        unit = torch.ones(self.h, dtype=self.x.dtype, device=self.x.device)

        def run():
            delta, residual = self.x, None
            for layer in range(self.layers):
                if residual is None:
                    xn, residual = fused_norm(delta, unit, 1e-6), delta
                else:
                    xn, residual = fused_norm(delta, unit, 1e-6, residual)
                torch.mm(xn, self.wqkv[layer].t(), out=self.qkv)
                xn, residual = fused_norm(F.linear(self.qkv[:, :self.nq], self.wo[layer]), unit, 1e-6, residual)
                delta = F.linear(act_and_mul(F.linear(xn, self.wgu[layer]), "silu"), self.wd[layer])
            return delta + residual
        return run

    def cublas_products(self):
        """A callable replaying only the chain's products through cuBLAS, each on the last one's output."""
        def run():
            x = self.x
            for layer in range(self.layers):
                torch.mm(x, self.wqkv[layer].t(), out=self.qkv)
                x = F.linear(self.qkv[:, :self.nq], self.wo[layer])
                F.linear(F.linear(x, self.wgu[layer])[:, :self.ni], self.wd[layer])
        return run


def rms_norm(x: torch.Tensor) -> torch.Tensor:
    """RMSNorm with a unit weight, as torch runs it: float32 statistics, the input's dtype out."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


def max_rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def configs(rows: int, sms: int) -> list[ChainConfig]:
    """One and two programs an SM, with items sized to the grid (Qwen3-0.6B's shapes in mind); input
    steps of 128 up to 64 rows, 64 above (a 3-stage pipeline of 256-row tiles would not fit in SMEM)."""
    bk = 128 if rows <= 64 else 64
    out = [ChainConfig(sms, (32, 16, 32, 16), (1, 2, 1, 2), bk), ChainConfig(2 * sms, (16, 16, 16, 16), (1, 4, 1, 4), bk)]
    if rows <= 64:
        out.append(ChainConfig(sms, (32, 16, 32, 16), (1, 2, 1, 2), 64))
    return out


def resident_programs(kernel, num_warps: int) -> int:
    """How many programs of a compiled kernel an H100/H200 SM holds at once (registers, shared memory)."""
    regs = max(1, kernel.n_regs) * 32 * num_warps
    return max(0, min(65536 // regs, (227 * 1024) // max(1, kernel.metadata.shared), 32))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen", choices=sorted(SHAPES))
    ap.add_argument("--rows", default="16,32,64,128,256")
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "persistent_chain.json"))
    args = ap.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from linear_shapes import graph_time_us

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    results = {"device": torch.cuda.get_device_name(), "model": args.model, "cases": []}
    print("rows  variant                          µs a layer  max rel err")
    for rows in [int(r) for r in args.rows.split(",")]:
        chain = Chain(args.model, rows)
        layers = chain.layers
        ref = chain.reference()
        assert torch.isfinite(ref).all()
        case = {"rows": rows, "layers": layers, "us_per_layer": {}}
        got = chain.engine_chain()()
        case["max_rel_err"] = {"engine launches": max_rel_err(got, ref)}
        for name, fn in (("engine launches", chain.engine_chain()), ("cublas products only", chain.cublas_products())):
            case["us_per_layer"][name] = graph_time_us(fn) / layers
            print(f"{rows:4d}  {name:32s} {case['us_per_layer'][name]:9.2f}", flush=True)
        for cfg in configs(rows, sms):
            chain.check_config(cfg)
            tag = f"G{cfg.programs} bn{cfg.bn} s{cfg.split} k{cfg.block_k}"
            try:
                fits = min(resident_programs(chain.launch(cfg, programs=1, prefetch=p), cfg.num_warps) for p in (False, True))
            except Exception as e:  # a tile the compiler rejects (shared memory) is skipped, named
                print(f"{rows:4d}  {tag}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                continue
            if fits * sms < cfg.programs:
                print(f"{rows:4d}  {tag}: only {fits} programs an SM fit", flush=True)
                continue
            for variant, kw in (("full", {}), ("prefetch", {"prefetch": True}), ("nosync", {"sync": False}),
                                ("synconly", {"work": False})):
                chain.err.zero_()
                chain.launch(cfg, **kw)
                torch.cuda.synchronize()
                checked = kw.get("sync", True) and kw.get("work", True)
                err = max_rel_err(chain.x, ref) if checked else float("nan")
                if chain.err.item():
                    print(f"{rows:4d}  {variant} {tag}: a barrier gave up waiting", flush=True)
                    continue
                if checked and not err <= 3e-2:
                    raise AssertionError(f"{variant} {tag}: max relative error {err:.3g}")
                us = graph_time_us(lambda: chain.launch(cfg, **kw)) / layers
                case["us_per_layer"][f"{variant} {tag}"] = us
                if checked:
                    case["max_rel_err"][f"{variant} {tag}"] = err
                print(f"{rows:4d}  {variant + ' ' + tag:32s} {us:9.2f}  {err:.2e}", flush=True)
        results["cases"].append(case)
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
