"""Prompt attention against the flash kernels torch ships: the Triton paged kernel vs torch's varlen flash attention.

    python benchmarks/prefill_attention_peers.py --tokens 1000,4096,16384 --heads 32:8

For one causal prompt of each length (bf16, D=128), prints the device time and causal TFLOP/s of:
the engine's Triton kernel over the paged cache (block size 16); torch's
``varlen_attn`` on contiguous K/V; the same over the paged cache (``block_table``), for each page size
torch's flash build accepts; and dense ``scaled_dot_product_attention``. CUDA-graph replay, L2 flushed.
"""
from __future__ import annotations

import argparse
import inspect
import json
import os

import torch

from attention_kernels import gpu_time_ms, make_batch, time_attention


def varlen_fn(n: int, hq: int, hkv: int, d: int, block_size: int | None, dtype):
    from torch.nn.attention.varlen import varlen_attn

    q = torch.randn(n, hq, d, device="cuda", dtype=dtype)
    cu = torch.tensor([0, n], dtype=torch.int32, device="cuda")
    kw = {}
    if block_size is None:
        k = torch.randn(n, hkv, d, device="cuda", dtype=dtype)
        v = torch.randn_like(k)
    else:
        pages = -(-n // block_size)
        k = torch.randn(pages, block_size, hkv, d, device="cuda", dtype=dtype)
        v = torch.randn_like(k)
        kw = dict(block_table=torch.randperm(pages, device="cuda").to(torch.int32)[None],
                  seqused_k=torch.tensor([n], dtype=torch.int32, device="cuda"))
    fn = lambda: varlen_attn(q, k, v, cu, cu, n, n, window_size=(-1, 0), enable_gqa=True, **kw)  # noqa: E731
    # Against dense SDPA over the same keys in logical order: the largest difference (bf16).
    kf, vf = (k, v) if block_size is None else (x[kw["block_table"][0].long()].flatten(0, 1)[:n] for x in (k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], kf.transpose(0, 1)[None], vf.transpose(0, 1)[None], is_causal=True, enable_gqa=True
    )[0].transpose(0, 1)
    return fn, (fn().float() - ref.float()).abs().max().item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", default="1000,4096,16384")
    ap.add_argument("--heads", default="32:8")
    ap.add_argument("--page-sizes", default="16,256")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    from torch.nn.attention import varlen

    print("torch", torch.__version__, "varlen_attn", inspect.signature(varlen.varlen_attn))
    hq, hkv = (int(x) for x in args.heads.split(":"))
    d, dtype = 128, torch.bfloat16
    rows = []
    for n in (int(x) for x in args.tokens.split(",")):
        tflops = lambda ms: 4 * hq * d * n * n / 2 / ms / 1e9  # noqa: E731
        row = {"tokens": n}
        tensors = make_batch([n], n, hq, hkv, d, 16, dtype)
        row["triton_paged16"] = time_attention(*tensors, n, n)
        del tensors
        cases = [("varlen_contiguous", None)] + [(f"varlen_paged{p}", p) for p in map(int, args.page_sizes.split(","))]
        for name, bs in cases:
            try:
                fn, diff = varlen_fn(n, hq, hkv, d, bs, dtype)
                row[name] = gpu_time_ms(fn)
                print(f"   {name}: max |diff| against dense SDPA {diff:.4f}")
            except Exception as exc:  # a page size or argument this torch build refuses
                row[name] = None
                print(f"   {name}: {type(exc).__name__}: {str(exc)[:160]}")
        q = torch.randn(1, hq, n, d, device="cuda", dtype=dtype)
        k = torch.randn(1, hkv, n, d, device="cuda", dtype=dtype)
        v = torch.randn_like(k)
        row["sdpa_dense"] = gpu_time_ms(
            lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        )
        rows.append(row)
        print(f"{n:6d} tokens " + " | ".join(
            f"{k} {v * 1e3:8.1f} us {tflops(v):5.0f} TF/s" for k, v in row.items() if k != "tokens" and v), flush=True)
    with open(os.path.join(args.out, "prefill_attention_peers.json"), "w") as f:
        json.dump({"heads": args.heads, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
