"""Which structure of prompt-attention kernel reaches flash speed in Triton: one query head per program, paged or not.

    python benchmarks/prefill_kernel_variants.py --tokens 1000,4096,16384 --heads 32:8

The engine's kernel packs a KV head's whole query group into each tile's rows (rows = tokens x heads)
and gathers every key through the block table. This script times a plainer kernel against it: each
program takes BLOCK_M tokens of one query head, loads K/V either from contiguous [T, Hkv, D] tensors
or through the block table, and splits its key loop into unmasked tiles and the causal diagonal.
Checked against dense SDPA first; CUDA-graph replay with L2 flushed.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os

import torch
import triton
import triton.language as tl

from attention_kernels import gpu_time_ms, make_batch, time_attention

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _tile(acc, m_i, l_i, q, n0, q_pos, k_base, v_base, bt_row, stride_kt, stride_kb, n_keys,
          D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, PAGED: tl.constexpr,
          MASK: tl.constexpr):
    k_pos = n0 + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, D)
    if PAGED:
        blk = tl.load(bt_row + k_pos // BLOCK_SIZE, mask=k_pos < n_keys, other=0).to(tl.int64)
        off = blk[:, None] * stride_kb + (k_pos % BLOCK_SIZE)[:, None] * stride_kt + dims[None, :]
    else:
        off = k_pos.to(tl.int64)[:, None] * stride_kt + dims[None, :]
    if MASK:
        k = tl.load(k_base + off, mask=(k_pos < n_keys)[:, None], other=0.0)
    else:
        k = tl.load(k_base + off)
    s = tl.dot(q, tl.trans(k))
    if MASK:
        s = tl.where(k_pos[None, :] <= q_pos[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if MASK:
        v = tl.load(v_base + off, mask=(k_pos < n_keys)[:, None], other=0.0)
    else:
        v = tl.load(v_base + off)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, m_new, l_i


@triton.jit
def _prefill_kernel(out_ptr, q_ptr, k_ptr, v_ptr, bt_ptr, n_tokens, scale,
                    stride_qt, stride_qh, stride_kt, stride_kh, stride_kb,
                    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr, PAGED: tl.constexpr):
    mblk = tl.program_id(0)
    head = tl.program_id(1)
    kvh = head // GROUP
    rows = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, D)
    q = tl.load(q_ptr + rows.to(tl.int64)[:, None] * stride_qt + head * stride_qh + dims[None, :],
                mask=(rows < n_tokens)[:, None], other=0.0)
    q = (q * (scale * LOG2E)).to(q.dtype)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    k_base = k_ptr + kvh * stride_kh
    v_base = v_ptr + kvh * stride_kh
    lo_diag = (mblk * BLOCK_M) // BLOCK_N * BLOCK_N
    for n0 in range(0, lo_diag, BLOCK_N):
        acc, m_i, l_i = _tile(acc, m_i, l_i, q, n0, rows, k_base, v_base, bt_ptr, stride_kt, stride_kb, n_tokens,
                              D, BLOCK_N, BLOCK_SIZE, PAGED, False)
    hi = tl.minimum((mblk + 1) * BLOCK_M, n_tokens)
    for n0 in range(lo_diag, hi, BLOCK_N):
        acc, m_i, l_i = _tile(acc, m_i, l_i, q, n0, rows, k_base, v_base, bt_ptr, stride_kt, stride_kb, n_tokens,
                              D, BLOCK_N, BLOCK_SIZE, PAGED, True)
    o = acc / l_i[:, None]
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_qt + head * stride_qh + dims[None, :],
             o.to(out_ptr.dtype.element_ty), mask=(rows < n_tokens)[:, None])


@triton.jit
def _tma_tile(acc, m_i, l_i, q, n0, q_pos, k_desc, v_desc, col, D: tl.constexpr, BLOCK_N: tl.constexpr,
              MASK: tl.constexpr):
    k = k_desc.load([n0, col])
    s = tl.dot(q, tl.trans(k))
    if MASK:
        k_pos = n0 + tl.arange(0, BLOCK_N)
        s = tl.where(k_pos[None, :] <= q_pos[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = v_desc.load([n0, col])
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, m_new, l_i


@triton.jit
def _prefill_tma_kernel(out_ptr, q_desc, k_desc, v_desc, n_tokens, scale, stride_qt, stride_qh,
                        GROUP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # The same kernel with Q, K and V tiles fetched by the tensor memory accelerator (Hopper's TMA).
    mblk = tl.program_id(0)
    head = tl.program_id(1)
    kvh = head // GROUP
    m0 = mblk * BLOCK_M
    rows = m0 + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, D)
    q = q_desc.load([m0, head * D])
    q = (q * (scale * LOG2E)).to(q.dtype)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    lo_diag = m0 // BLOCK_N * BLOCK_N
    for n0 in range(0, lo_diag, BLOCK_N):
        acc, m_i, l_i = _tma_tile(acc, m_i, l_i, q, n0, rows, k_desc, v_desc, kvh * D, D, BLOCK_N, False)
    hi = tl.minimum(m0 + BLOCK_M, n_tokens)
    for n0 in range(lo_diag, hi, BLOCK_N):
        acc, m_i, l_i = _tma_tile(acc, m_i, l_i, q, n0, rows, k_desc, v_desc, kvh * D, D, BLOCK_N, True)
    o = acc / l_i[:, None]
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_qt + head * stride_qh + dims[None, :],
             o.to(out_ptr.dtype.element_ty), mask=(rows < n_tokens)[:, None])


def tma_fn(q, k, v, block_m: int, block_n: int, warps: int, stages: int):
    from triton.tools.tensor_descriptor import TensorDescriptor

    n, hq, d = q.shape
    hkv = k.shape[1]
    out = torch.empty_like(q)
    qd = TensorDescriptor.from_tensor(q.view(n, hq * d), [block_m, d])
    kd = TensorDescriptor.from_tensor(k.view(n, hkv * d), [block_n, d])
    vd = TensorDescriptor.from_tensor(v.view(n, hkv * d), [block_n, d])
    grid = (triton.cdiv(n, block_m), hq)

    def fn():
        _prefill_tma_kernel[grid](out, qd, kd, vd, n, d**-0.5, q.stride(0), q.stride(1), GROUP=hq // hkv, D=d,
                                  BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages)
        return out

    return fn


def variant_fn(q, k, v, bt, paged: bool, block_m: int, block_n: int, warps: int, stages: int):
    n, hq, d = q.shape
    hkv = k.shape[-2]
    out = torch.empty_like(q)
    # k: [T, Hkv, D] contiguous, or the cache [num_blocks, block_size, Hkv, D].
    stride_kb = k.stride(0) if paged else 0
    stride_kt = k.stride(1) if paged else k.stride(0)
    stride_kh = k.stride(-2)
    grid = (triton.cdiv(n, block_m), hq)

    def fn():
        _prefill_kernel[grid](out, q, k, v, bt, n, d**-0.5, q.stride(0), q.stride(1), stride_kt, stride_kh, stride_kb,
                              GROUP=hq // hkv, D=d, BLOCK_M=block_m, BLOCK_N=block_n,
                              BLOCK_SIZE=k.shape[1] if paged else 16, PAGED=paged,
                              num_warps=warps, num_stages=stages)
        return out

    return fn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", default="1000,4096,16384")
    ap.add_argument("--heads", default="32:8")
    ap.add_argument("--kinds", default="contiguous,paged,tma", help="K/V loads: contiguous, paged, tma")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    hq, hkv = (int(x) for x in args.heads.split(":"))
    d, dtype = 128, torch.bfloat16
    configs = list(itertools.product((64, 128), (64, 128), (4, 8), (2, 3)))
    rows = []
    for n in (int(x) for x in args.tokens.split(",")):
        tflops = lambda ms: 4 * hq * d * n * n / 2 / ms / 1e9  # noqa: E731
        q, cache, bt, seq, qsl = make_batch([n], n, hq, hkv, d, 16, dtype)
        engine = time_attention(q, cache, bt, seq, qsl, n, n)
        kc, vc = cache[0], cache[1]
        kf = kc[bt[0].long()].flatten(0, 1)[:n].contiguous()
        vf = vc[bt[0].long()].flatten(0, 1)[:n].contiguous()
        ref = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1)[None], kf.transpose(0, 1)[None], vf.transpose(0, 1)[None], is_causal=True,
            enable_gqa=True)[0].transpose(0, 1)
        sdpa = gpu_time_ms(lambda: torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1)[None], kf.transpose(0, 1)[None], vf.transpose(0, 1)[None], is_causal=True,
            enable_gqa=True))
        row = {"tokens": n, "engine_us": engine * 1e3, "sdpa_us": sdpa * 1e3}
        for kind in args.kinds.split(","):
            paged = kind == "paged"
            best = None
            for bm, bn, w, st in configs:
                if kind == "tma":
                    fn = tma_fn(q, kf, vf, bm, bn, w, st)
                else:
                    fn = variant_fn(q, kc if paged else kf, vc if paged else vf, bt[0], paged, bm, bn, w, st)
                try:
                    diff = (fn().float() - ref.float()).abs().max().item()
                    t = gpu_time_ms(fn)
                except Exception as exc:  # out of shared memory or registers
                    print(f"   {kind} {bm}/{bn}/{w}/{st}: {type(exc).__name__}: {str(exc)[:120]}")
                    continue
                if diff > 0.05:
                    print(f"   {kind} {bm}/{bn}/{w}/{st}: WRONG, max diff {diff}")
                    continue
                if best is None or t < best[0]:
                    best = (t, f"{bm}/{bn}/{w}/{st}", diff)
            if best is not None:
                row[kind] = {"us": best[0] * 1e3, "cfg": best[1], "max_diff": best[2]}
        rows.append(row)
        print(f"{n:6d} tokens: engine {engine * 1e3:8.1f} us {tflops(engine):4.0f} TF/s | SDPA {sdpa * 1e3:8.1f} us "
              f"{tflops(sdpa):4.0f} | one head a program: " + " | ".join(
                  f"{k} {row[k]['us']:8.1f} us {tflops(row[k]['us'] / 1e3):4.0f} ({row[k]['cfg']})"
                  for k in args.kinds.split(",") if k in row), flush=True)
    with open(os.path.join(args.out, f"prefill_kernel_variants_{hq}_{hkv}.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
