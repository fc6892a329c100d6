"""Where float8 decode attention loses its time: a minimal paged decode kernel in three forms, timed on CUDA.

The engine's decode kernel reads a float8 cache at ~3 TB/s against a 4.5 TB/s read ceiling, bound by
the instructions that widen each tile and lay it out for the tensor cores. This script isolates two
suspects with a kernel that does only paged decode attention (no cache write, rotary or split):
- ``plain``: K and V tiles as the engine stores them, [block, token, head, dim];
- ``vt``: V stored transposed inside each block, [block, head, dim, token]. The product P @ V then
  reads V with the tokens (its reduction dimension) contiguous, the order the tensor cores take an
  8-bit operand in; a token-major V must be transposed byte by byte on the way;
- ``qk8``: q split into two e4m3 halves (hi, and the rest of q - hi), so that Q K^T runs as two
  float8 products with no widening of K (precision about bfloat16's);
- ``vt+qk8``: both.

Every form is checked against a float32 reference first. On the CPU (Triton's interpreter, float16
caches, no float8 products) ``--check`` runs the checks only.

    python benchmarks/fp8_decode_layouts.py [--heads 16:8] [--cases 256:640,128:1000] [--check]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch
import triton
import triton.language as tl

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

LOG2E = tl.constexpr(1.4426950408889634)
FORMS = ("plain", "vt", "qk8", "vt+qk8")


@triton.jit
def _decode_kernel(
    out_ptr,  # [B, Hq, D] float32
    q_ptr,  # [B, Hq, D] 16-bit
    k_ptr,  # [num_blocks, BS, Hkv, D]
    v_ptr,  # [num_blocks, BS, Hkv, D], or [num_blocks, Hkv, D, BS] when V_T
    bt_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32
    scale,
    stride_qb,  # q and out share it (both [B, Hq, D] contiguous)
    stride_bt,
    stride_kb, stride_kp, stride_kh,
    stride_vb, stride_vp, stride_vh, stride_vd,
    HEAD_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    BS: tl.constexpr,
    V_T: tl.constexpr,
    QK8: tl.constexpr,
):
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_SIZE)
    row_ok = rows < GROUP
    head = kv_head * GROUP + tl.where(row_ok, rows, 0)
    q = tl.load(q_ptr + req.to(tl.int64) * stride_qb + head[:, None] * HEAD_SIZE + dims[None, :],
                mask=row_ok[:, None], other=0.0)
    qf = q.to(tl.float32)
    if QK8:
        q_hi = qf.to(k_ptr.dtype.element_ty)
        q_lo = (qf - q_hi.to(tl.float32)).to(k_ptr.dtype.element_ty)
    else:
        q16 = tl.clamp(qf, -65504.0, 65504.0).to(tl.float16)
    seq_len = tl.load(seq_lens_ptr + req)
    bt_row = bt_ptr + req.to(tl.int64) * stride_bt
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_SIZE], tl.float32)
    for n0 in range(0, seq_len, TILE_N):
        pos = n0 + tl.arange(0, TILE_N)
        inside = pos < seq_len
        blk = tl.load(bt_row + pos // BS, mask=inside, other=0).to(tl.int64)
        slot = pos % BS
        k = tl.load(k_ptr + blk[:, None] * stride_kb + slot[:, None] * stride_kp + kv_head * stride_kh + dims[None, :])
        if QK8:
            s = tl.dot(q_hi, tl.trans(k)) + tl.dot(q_lo, tl.trans(k))
        else:
            s = tl.dot(q16, tl.trans(k.to(tl.float16)))
        s = tl.where(inside[None, :], s * (scale * LOG2E), float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if V_T:
            vt = tl.load(v_ptr + blk[None, :] * stride_vb + kv_head * stride_vh + dims[:, None] * stride_vd
                         + slot[None, :] * stride_vp)  # [HEAD_SIZE, TILE_N]
            v = tl.trans(vt)
        else:
            v = tl.load(v_ptr + blk[:, None] * stride_vb + slot[:, None] * stride_vp + kv_head * stride_vh
                        + dims[None, :] * stride_vd)
        acc = tl.dot(p.to(tl.float16), v.to(tl.float16), acc * alpha[:, None])
        m_i = m_new
    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + req.to(tl.int64) * stride_qb + head[:, None] * HEAD_SIZE + dims[None, :], o,
             mask=row_ok[:, None])


def make_case(batch: int, ctx: int, hq: int, hkv: int, d: int, bs: int, cache_dtype, device, seed: int = 0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    nblk = math.ceil(ctx / bs)
    perm = torch.randperm(batch * nblk, generator=gen).to(torch.int32)
    bt = perm.view(batch, nblk).to(device)
    k = (torch.randn(batch * nblk, bs, hkv, d, generator=gen)).to(device).to(cache_dtype)
    v = (torch.randn(batch * nblk, bs, hkv, d, generator=gen)).to(device).to(cache_dtype)
    q = torch.randn(batch, hq, d, generator=gen).to(device).to(torch.bfloat16 if device.type == "cuda" else torch.float16)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    return q, k, v, bt, lens


def reference(q, k, v, bt, lens, scale) -> torch.Tensor:  # [B, Hq, D] float32
    batch, hq, d = q.shape
    hkv = k.shape[2]
    out = torch.empty(batch, hq, d, dtype=torch.float32, device=q.device)
    for b in range(batch):
        n = int(lens[b])
        blocks = bt[b].long()
        kk = k[blocks].flatten(0, 1)[:n].float()  # [n, Hkv, D]
        vv = v[blocks].flatten(0, 1)[:n].float()
        kk = kk.repeat_interleave(hq // hkv, dim=1)
        vv = vv.repeat_interleave(hq // hkv, dim=1)
        w = torch.softmax(torch.einsum("hd,nhd->hn", q[b].float(), kk) * scale, dim=-1)
        out[b] = torch.einsum("hn,nhd->hd", w, vv)
    return out


def run_form(form: str, q, k, v, v_t, bt, lens, scale, tile_n: int, warps: int, stages: int):
    batch, hq, d = q.shape
    hkv = k.shape[2]
    group = hq // hkv
    out = torch.empty(batch, hq, d, dtype=torch.float32, device=q.device)
    use_vt = form.startswith("vt")
    vv = v_t if use_vt else v
    if use_vt:  # [nb, Hkv, D, BS]
        strides_v = (vv.stride(0), vv.stride(3), vv.stride(1), vv.stride(2))
    else:  # [nb, BS, Hkv, D]
        strides_v = (vv.stride(0), vv.stride(1), vv.stride(2), vv.stride(3))

    def launch():
        _decode_kernel[(batch, hkv)](
            out, q, k, vv, bt, lens, scale, q.stride(0), bt.stride(0),
            k.stride(0), k.stride(1), k.stride(2), *strides_v,
            HEAD_SIZE=d, GROUP=group, BLOCK_M=max(16, triton.next_power_of_2(group)), TILE_N=tile_n, BS=k.shape[1],
            V_T=use_vt, QK8=form.endswith("qk8"), num_warps=warps, num_stages=stages,
        )

    return out, launch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", default="16:8")
    ap.add_argument("--cases", default="256:640,128:1000")
    ap.add_argument("--shapes", default="32:1:2,64:2:2", help="TILE:WARPS:STAGES,...")
    ap.add_argument("--check", action="store_true", help="correctness only (the CPU runs this in the interpreter)")
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "fp8_decode_layouts.json"))
    args = ap.parse_args()
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda" if on_gpu else "cpu")
    cache_dtype = torch.float8_e4m3fn if on_gpu else torch.float16
    forms = FORMS if on_gpu else ("plain", "vt")  # the interpreter has no float8 products
    hq, hkv = (int(x) for x in args.heads.split(":"))
    d, bs = 128, 16
    results: dict = {"heads": args.heads, "cache": str(cache_dtype), "cases": {}}
    cases = ["3:70"] if args.check else args.cases.split(",")
    for case in cases:
        batch, ctx = (int(x) for x in case.split(":"))
        q, k, v, bt, lens = make_case(batch, ctx, hq, hkv, d, bs, cache_dtype, device)
        v_t = v.permute(0, 2, 3, 1).contiguous()  # [nb, Hkv, D, BS]
        scale = d**-0.5
        ref = reference(q, k, v, bt, lens, scale)
        nbytes = 2 * batch * ctx * hkv * d * k.element_size()
        row: dict = {}
        for form in forms:
            for shape in args.shapes.split(","):
                tile_n, warps, stages = (int(x) for x in shape.split(":"))
                key = f"{form} {shape}"
                try:
                    out, launch = run_form(form, q, k, v, v_t, bt, lens, scale, tile_n, warps, stages)
                    launch()
                    err = (out - ref).abs().max().item()
                except Exception as exc:  # a form the compiler refuses on this GPU
                    row[key] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
                    print(f"{case:>9s} {key:18s} failed: {row[key]['error']}", flush=True)
                    continue
                entry = {"max_abs_err": err}
                if not args.check:
                    import triton.testing

                    ms = triton.testing.do_bench_cudagraph(launch, rep=50)
                    entry.update(us=ms * 1e3, tbps=nbytes / (ms * 1e-3) / 1e12)
                row[key] = entry
                rate = f"{entry['us']:8.1f} us {entry['tbps']:5.2f} TB/s" if "us" in entry else ""
                print(f"{case:>9s} {key:18s} max |err| {err:.2e} {rate}", flush=True)
                if args.check:
                    assert err < 2e-2, (case, key, err)
        results["cases"][case] = row
    if not args.check:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
