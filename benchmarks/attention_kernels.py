"""Times the Triton paged-attention kernels on CUDA: decode KV-read bandwidth against a device copy, split-KV, prefill."""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os

import torch


def copy_bandwidth(nbytes: int = 1 << 31) -> float:
    """Device-to-device copy rate in TB/s, counting bytes read plus bytes written."""
    import triton.testing

    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200)
    src = dst = None  # frees both; the lambda above still names them, so they are rebound, not deleted
    return 2 * nbytes / (ms * 1e-3) / 1e12


# Physical order of a cache block: "nhd" stores [block_size, Hkv, D] (each token's heads side by side),
# "hnd" stores [Hkv, block_size, D] (each head's page contiguous). The kernel sees the same logical
# [num_blocks, block_size, Hkv, D] view either way, through its strides.
KV_LAYOUT = "nhd"


def make_batch(seq_lens, query_len, num_heads, num_kv_heads, head_size, block_size, dtype, seed=0, cache_dtype=None):
    """Cache, query and metadata tensors for requests whose last ``query_len`` tokens are new; blocks shuffled."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    blocks = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(blocks)
    perm = torch.randperm(num_blocks, generator=gen, device="cuda").to(torch.int32)
    block_table = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32, device="cuda")
    start = 0
    for i, n in enumerate(blocks):
        block_table[i, :n] = perm[start : start + n]
        start += n
    if KV_LAYOUT == "hnd":
        kv_cache = torch.empty(2, num_blocks, num_kv_heads, block_size, head_size, dtype=dtype, device="cuda")
        kv_cache = kv_cache.permute(0, 1, 3, 2, 4)
    else:
        kv_cache = torch.empty(2, num_blocks, block_size, num_kv_heads, head_size, dtype=dtype, device="cuda")
    kv_cache.normal_(generator=gen)
    if cache_dtype is not None and cache_dtype != dtype:
        kv_cache = kv_cache.to(cache_dtype)  # float8: the same values, rounded
    num_tokens = len(seq_lens) * query_len
    query = torch.randn(num_tokens, num_heads, head_size, generator=gen, device="cuda").to(dtype)
    qsl = torch.arange(0, num_tokens + 1, query_len, dtype=torch.int32, device="cuda")
    seq = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    return query, kv_cache, block_table, seq, qsl


def gpu_time_ms(fn, reps: int = 30, flush_mode: str = "write") -> float:
    """Median device time of ``fn`` replayed from a CUDA graph, with L2 flushed before each replay.

    A graph strips the Python launch cost (decode runs under graphs in a serving engine), and the
    flush keeps small working sets from being served out of the 60 MB L2. ``flush_mode`` "write" flushes
    with a memset, which leaves the L2 full of dirty lines; "read" with a sum, which leaves clean ones.
    """
    fn()  # compile and warm the allocator outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    graph.replay()
    for start, end in zip(starts, ends):
        if flush_mode == "write":
            flush.zero_()
        else:
            flush.sum()
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
    return times[len(times) // 2]


def attention_fn(query, kv_cache, block_table, seq_lens, qsl, max_query_len, max_seq_len, **kw):
    from pagedllm.kernels.attention.paged_attention import paged_attention

    out = torch.empty_like(query)
    head_size = query.shape[-1]

    def fn():
        paged_attention(
            query, kv_cache[0], kv_cache[1], block_table, seq_lens, qsl,
            num_reqs=block_table.shape[0], max_query_len=max_query_len, max_seq_len=max_seq_len,
            scale=head_size**-0.5, out=out, **kw,
        )

    return fn


def time_attention(*args, **kw) -> float:
    """Device time per call (CUDA graph), in ms."""
    return gpu_time_ms(attention_fn(*args, **kw))


def time_attention_eager(*args, **kw) -> float:
    """Wall time per eager call including Python launch cost, in ms (triton's do_bench)."""
    import triton.testing

    return triton.testing.do_bench(attention_fn(*args, **kw), warmup=10, rep=60)


def kv_read_bytes(seq_lens, num_kv_heads, head_size, dtype) -> int:
    return 2 * sum(seq_lens) * num_kv_heads * head_size * torch.finfo(dtype).bits // 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sweep", action="store_true", help="also sweep decode tile configs")
    parser.add_argument("--heads", default="32:8", help="query heads:KV heads (head size 128)")
    parser.add_argument("--decode-cases", default="64:1024,64:4096,256:1024,256:4096", help="BATCH:CONTEXT[:SPLITS],...")
    parser.add_argument("--decode-only", action="store_true", help="skip the split-KV and prefill sections")
    parser.add_argument("--sections", default="decode,ragged,split,prefill", help="which sections to run, comma-separated")
    parser.add_argument("--prefill-tokens", type=int, default=4096, help="prompt length of the prefill section")
    parser.add_argument("--kv-layout", choices=("nhd", "hnd"), default="nhd",
                        help="physical order inside a cache block: tokens outermost (nhd) or heads (hnd)")
    parser.add_argument("--block-size", type=int, default=16, help="KV cache block size")
    parser.add_argument("--kv-dtype", choices=("auto", "fp8", "fp8_e5m2"), default="auto",
                        help="decode section: the KV cache's element type (auto: bf16, as the activations)")
    parser.add_argument("--configs", default="",
                        help="decode section: also time these launch shapes, TILE:WARPS:STAGES[:MAXREGS],...")
    parser.add_argument("--pieces-kv", default="fp8,fp8_e5m2", help="pieces section: float8 cache dtypes")
    parser.add_argument("--pieces-batches", default="64,128,160,192,256", help="pieces section: batch sizes")
    parser.add_argument("--pieces-warps", default="8,16",
                        help="pieces section: one-warp programs an SM of the launches to time (the engine's: 8)")
    parser.add_argument("--pieces-extras", action="store_true",
                        help="pieces section: fuse the cache write and rotary embedding, as the engine does")
    parser.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "attention_bench.json"))
    args = parser.parse_args()
    global KV_LAYOUT
    KV_LAYOUT = args.kv_layout
    sections = {"decode"} if args.decode_only else set(args.sections.split(","))
    if not torch.cuda.is_available():
        print("attention_kernels: no CUDA device; nothing to time")
        return

    from pagedllm.kernels.attention.launch_config import KernelConfig, choose_num_splits, default_config

    props = torch.cuda.get_device_properties(0)
    hq, hkv = (int(v) for v in args.heads.split(":"))
    d, bs, dtype = 128, args.block_size, torch.bfloat16  # 32:8 is Llama-3-8B attention, 16:8 Qwen3-0.6B
    from pagedllm.config import resolve_kv_cache_dtype

    cache_dtype = resolve_kv_cache_dtype(args.kv_dtype, dtype)
    results: dict = {"device": props.name, "sms": props.multi_processor_count}
    copy_bw = copy_bandwidth()
    results["copy_tbps"] = copy_bw
    print(f"{props.name}: {props.multi_processor_count} SMs; torch D2D copy {copy_bw:.2f} TB/s (read+write); "
          f"KV layout {args.kv_layout}, block size {bs}")

    print(f"\n== decode, {hq}q/{hkv}kv heads, D=128, bf16, {cache_dtype} cache, block 16; device time from CUDA-graph "
          "replay, L2 flushed;")
    print("   KV read bandwidth and its fraction of the copy rate; eager = do_bench wall time incl. launch cost")
    results["decode"] = []
    decode_cases = args.decode_cases.split(",") if "decode" in sections else []
    for case in decode_cases:
        batch, ctx, *forced = (int(v) for v in case.split(":"))  # BATCH:CONTEXT[:SPLITS]
        seq_lens = [ctx] * batch
        tensors = make_batch(seq_lens, 1, hq, hkv, d, bs, dtype, cache_dtype=cache_dtype)
        nbytes = kv_read_bytes(seq_lens, hkv, d, cache_dtype)
        sms = props.multi_processor_count
        splits = forced[0] if forced else choose_num_splits(batch, 1, ctx, hkv, sms)
        cfg = default_config(d, hq // hkv, 1, max_seq_len=ctx, num_reqs=batch, num_kv_heads=hkv, num_sms=sms,
                             split=splits > 1, cache_bytes=torch.finfo(cache_dtype).bits // 8)
        kw = {"num_splits": splits} if forced else {}
        ms = time_attention(*tensors, 1, ctx, **kw)
        eager = time_attention_eager(*tensors, 1, ctx, **kw)
        bw = nbytes / (ms * 1e-3) / 1e12
        row = {"batch": batch, "ctx": ctx, "splits": splits, "us": ms * 1e3, "eager_us": eager * 1e3, "tbps": bw,
               "frac_of_copy": bw / copy_bw}
        line = (f"batch {batch:4d} ctx {ctx:5d} splits {splits:2d} tile {cfg.tile_n:3d} warps {cfg.num_warps} regs "
                f"{cfg.max_regs or '-'}: {ms * 1e3:8.1f} us  {bw:5.2f} TB/s  "
                f"{bw / copy_bw:5.1%}  (eager {eager * 1e3:7.1f} us)")
        if args.sweep:
            best = (ms, None)
            for tile_n, warps, stages in itertools.product((32, 64, 128), (2, 4, 8), (2, 3, 4)):
                cfg = KernelConfig(block_m=16, tile_n=tile_n, num_warps=warps, num_stages=stages)
                try:
                    t = time_attention(*tensors, 1, ctx, config=cfg, num_splits=1)
                except Exception as exc:  # out of shared memory for the deepest pipelines
                    print(f"   {cfg}: {type(exc).__name__}")
                    continue
                best = min(best, (t, cfg), key=lambda x: x[0])
            bw_best = nbytes / (best[0] * 1e-3) / 1e12
            row["best_cfg"] = str(best[1])
            row["best_tbps"] = bw_best
            line += f" | best {bw_best:5.2f} TB/s ({bw_best / copy_bw:5.1%}) with {best[1]}"
        if args.configs:
            row["configs"] = {}
            for spec in args.configs.split(","):
                tile_n, warps, stages, *regs = spec.split(":")
                cfg = KernelConfig(block_m=16, tile_n=int(tile_n), num_warps=int(warps), num_stages=int(stages),
                                   max_regs=int(regs[0]) if regs else None)
                ckw = dict(kw, config=cfg, num_splits=splits)
                t = time_attention(*tensors, 1, ctx, **ckw)
                row["configs"][spec] = {"us": t * 1e3, "tbps": nbytes / (t * 1e-3) / 1e12}
                line += f"\n      {spec:>10s}: {t * 1e3:8.1f} us  {nbytes / (t * 1e-3) / 1e12:5.2f} TB/s"
        print(line, flush=True)
        results["decode"].append(row)
        tensors = None
        torch.cuda.empty_cache()
    if "ragged" in sections:
        ragged_section(results, hq, hkv, d, bs, dtype, copy_bw)
    if "intercept" in sections:
        intercept_section(results, hq, hkv, d, bs, dtype)
    if "pieces" in sections:
        pieces_section(results, args, hq, hkv, d, bs, dtype, copy_bw)
    if "split" in sections:
        split_section(results, hq, hkv, d, bs, dtype, copy_bw)
    if "prefill" in sections:
        prefill_section(results, args, hq, hkv, d, bs, dtype)
    _write(args.json, results)


def ragged_section(results, hq, hkv, d, bs, dtype, copy_bw: float) -> None:
    """Decode of 256 requests whose contexts differ (workload 1 mid-run): does the launch order matter?"""
    import random

    print("\n== ragged decode: 256 requests, contexts U[100, 2048]; request order and forced splits")
    rng = random.Random(0)
    base = [rng.randint(100, 2048) for _ in range(256)]
    mean = sum(base) // len(base)
    # (name, contexts, forced splits, pass the engine's longest-first decode_order)
    cases = [
        ("random order", base, None, False),
        ("sorted longest first", sorted(base, reverse=True), None, False),
        ("shortest first", sorted(base), None, False),
        ("random + decode_order", base, None, True),
        ("random, 2 splits", base, 2, False),
        ("random, 4 splits", base, 4, False),
        (f"uniform {mean}", [mean] * len(base), None, False),
        ("uniform + decode_order", [mean] * len(base), None, True),
    ]
    results["ragged"] = []
    for name, seq_lens, splits, ordered in cases:
        tensors = make_batch(seq_lens, 1, hq, hkv, d, bs, dtype)
        nbytes = kv_read_bytes(seq_lens, hkv, d, dtype)
        kw = {} if splits is None else {"num_splits": splits}
        if ordered:
            kw["decode_order"] = torch.argsort(-tensors[3].long(), stable=True).to(torch.int32)
        ms = time_attention(*tensors, 1, max(seq_lens), **kw)
        bw = nbytes / (ms * 1e-3) / 1e12
        print(f"{name:22s}: {ms * 1e3:8.1f} us  {bw:5.2f} TB/s  {bw / copy_bw:5.1%}", flush=True)
        results["ragged"].append({"case": name, "us": ms * 1e3, "tbps": bw, "frac_of_copy": bw / copy_bw})
        tensors = None
        torch.cuda.empty_cache()


def split_section(results, hq, hkv, d, bs, dtype, copy_bw: float) -> None:
    from pagedllm.kernels.attention.launch_config import choose_num_splits

    props = torch.cuda.get_device_properties(0)
    print("\n== split-KV: few long decodes (same heads), single pass vs heuristic vs forced partitions")
    results["split"] = []
    for batch, ctx in [(1, 8192), (1, 32768), (2, 16384), (4, 8192), (4, 32768)]:
        seq_lens = [ctx] * batch
        tensors = make_batch(seq_lens, 1, hq, hkv, d, bs, dtype)
        nbytes = kv_read_bytes(seq_lens, hkv, d, dtype)
        chosen = choose_num_splits(batch, 1, ctx, hkv, props.multi_processor_count)
        timings = {}
        for splits in sorted({1, chosen, 4, 8, 16, 32, 64}):
            timings[splits] = time_attention(*tensors, 1, ctx, num_splits=splits)
        eager = time_attention_eager(*tensors, 1, ctx)
        one, heur = timings[1], timings[chosen]
        best_s = min(timings, key=timings.get)
        tb = lambda ms: nbytes / (ms * 1e-3) / 1e12  # noqa: E731
        print(
            f"batch {batch} ctx {ctx:5d}: single {one * 1e3:7.1f} us ({tb(one):4.2f} TB/s) | heuristic {chosen:2d} "
            f"splits {heur * 1e3:7.1f} us ({tb(heur):4.2f} TB/s, {tb(heur) / copy_bw:5.1%}) | best {best_s:2d} "
            f"splits {timings[best_s] * 1e3:7.1f} us | heuristic eager {eager * 1e3:6.1f} us",
            flush=True,
        )
        results["split"].append(
            {"batch": batch, "ctx": ctx, "chosen": chosen, "us": {k: v * 1e3 for k, v in timings.items()}}
        )
        tensors = None
        torch.cuda.empty_cache()


def intercept_section(results, hq, hkv, d, bs, dtype) -> None:
    """What a decode launch costs beyond its KV bytes, and what the fused decode extras add to it.

    For 256 requests: one plain launch timed after an L2 flush that leaves dirty lines (a memset) and
    after one that leaves clean lines (a read); then 8 launches back to back in one graph over 8
    caches, as consecutive layers run, plain and with what the engine fuses into decode: the new
    token's cache write and the rotary embedding of q and k.
    """
    print("\n== intercept: one decode launch vs 8 layers back to back (256 requests)")
    results["intercept"] = []
    gen = torch.Generator(device="cuda").manual_seed(1)
    for ctx in (320, 1000):
        seq_lens = [ctx] * 256
        layers = [make_batch(seq_lens, 1, hq, hkv, d, bs, dtype, seed=i) for i in range(8)]
        nbytes = kv_read_bytes(seq_lens, hkv, d, dtype)
        new_k = torch.randn(256, hkv, d, generator=gen, device="cuda").to(dtype)
        new_v = torch.randn(256, hkv, d, generator=gen, device="cuda").to(dtype)
        inv_freq = 1.0 / (1e6 ** (torch.arange(0, d, 2, device="cuda", dtype=torch.float32) / d))

        def fns(extra: str):
            out = []
            for t in layers:
                block_table = t[2]
                slots = (block_table[:, (ctx - 1) // bs].long() * bs + (ctx - 1) % bs).contiguous()
                kw = {}
                if extra:
                    kw["new_kv"] = (new_k, new_v, slots)
                if "rope" in extra:
                    kw["rope"] = (inv_freq, 1.0)
                out.append(attention_fn(*t, 1, ctx, **kw))
            return out

        plain = fns("")
        row = {"ctx": ctx, "bytes_us_at_4p5": nbytes / 4.5e6,
               "one_dirty_flush_us": gpu_time_ms(plain[0]) * 1e3,
               "one_clean_flush_us": gpu_time_ms(plain[0], flush_mode="read") * 1e3}
        line = (f"ctx {ctx:5d}: bytes at 4.5 TB/s {nbytes / 4.5e6:6.1f} us | one: dirty flush "
                f"{row['one_dirty_flush_us']:6.1f}, clean {row['one_clean_flush_us']:6.1f} | 8 in a row, each:")
        for name in ("plain", "write", "write+rope"):
            group = plain if name == "plain" else fns(name)
            row[f"eight_{name}_us_each"] = gpu_time_ms(lambda: [f() for f in group]) / 8 * 1e3
            line += f" {name} {row[f'eight_{name}_us_each']:6.1f}"
        print(line, flush=True)
        results["intercept"].append(row)
        layers = None
        torch.cuda.empty_cache()


def pieces_section(results, args, hq, hkv, d, bs, dtype, copy_bw: float) -> None:
    """Ragged decode batches (contexts U[100, 2048], workload 1 mid-run) in one program per (request, KV
    head), longest first (the default launch), against the same batch cut into even pieces that
    persistent programs take in turn (``decode_pieces.py``), for float8 caches (a bf16 cache never takes them:
    workload 1 ran at 0.81x with them)."""
    import random

    from pagedllm.kernels.attention import decode_pieces as dp
    from pagedllm.kernels.attention.launch_config import pieces_config, pieces_programs
    from pagedllm.config import resolve_kv_cache_dtype

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"\n== decode pieces: {hq}q/{hkv}kv, contexts U[100, 2048], us a launch (CUDA graph, L2 flushed)")
    results["pieces"] = []
    for kv_dtype in args.pieces_kv.split(","):
        cache_dtype = resolve_kv_cache_dtype(kv_dtype, dtype)
        for batch in (int(b) for b in args.pieces_batches.split(",")):
            rng = random.Random(batch)
            seq_lens = [rng.randint(100, 2048) for _ in range(batch)]
            tensors = make_batch(seq_lens, 1, hq, hkv, d, bs, dtype, cache_dtype=cache_dtype)
            query, kv_cache, block_table, lens, qsl = tensors
            nbytes = kv_read_bytes(seq_lens, hkv, d, cache_dtype)
            order = torch.argsort(-lens.long(), stable=True).to(torch.int32)
            extras = {}
            if args.pieces_extras:
                # What the engine fuses into decode: the new token's cache write and the rotary embedding.
                last = (lens.long() - 1)
                slots = (block_table.gather(1, (last // bs)[:, None]).squeeze(1).long() * bs + last % bs)
                new_k = torch.randn(batch, hkv, d, device="cuda").to(dtype)
                new_v = torch.randn(batch, hkv, d, device="cuda").to(dtype)
                inv_freq = 1.0 / (1e6 ** (torch.arange(0, d, 2, device="cuda", dtype=torch.float32) / d))
                extras = {"new_kv": (new_k, new_v, slots), "rope": (inv_freq, 1.0)}
            row = {"kv": kv_dtype, "batch": batch, "default_us": time_attention(
                *tensors, 1, max(seq_lens), decode_order=order, **extras) * 1e3}
            cfg = pieces_config(d, hq // hkv)
            out = torch.empty_like(query)
            line = f"{kv_dtype:5s} batch {batch:4d}: default {row['default_us']:7.1f} us"
            for warps_per_sm in (int(v) for v in args.pieces_warps.split(",")):
                programs = pieces_programs(sms, hkv, cfg.num_warps, warps_per_sm)
                ends = dp.piece_ends(lens, order, batch, cfg.tile_n, programs)

                def fn(ends=ends, programs=programs):
                    dp.decode_pieces_attention(
                        query, kv_cache[0], kv_cache[1], block_table, lens, ends, out, num_reqs=batch,
                        scale=d**-0.5, block_m=cfg.block_m, tile_n=cfg.tile_n, num_warps=cfg.num_warps,
                        num_stages=cfg.num_stages, programs_per_head=programs, decode_order=order, **extras)

                us = gpu_time_ms(fn) * 1e3
                name = f"pieces_w{warps_per_sm}"
                row[name] = us
                line += f" | {name} {us:7.1f} ({row['default_us'] / us:4.2f}x)"
            row["piece_ends_us"] = gpu_time_ms(lambda: dp.piece_ends(lens, order, batch, cfg.tile_n, 132)) * 1e3
            row["tbps_default"] = nbytes / row["default_us"] / 1e6
            print(line + f" | ends {row['piece_ends_us']:.1f} us; default {row['tbps_default']:.2f} TB/s", flush=True)
            results["pieces"].append(row)
            tensors = None
            torch.cuda.empty_cache()


def prefill_section(results, args, hq, hkv, d, bs, dtype) -> None:
    from pagedllm.kernels.attention.launch_config import KernelConfig, default_config

    print(f"\n== prefill: one {args.prefill_tokens}-token prompt, {hq}q/{hkv}kv, D=128, bf16 (causal FLOPs) vs torch SDPA (dense, not paged)")
    n = args.prefill_tokens
    tensors = make_batch([n], n, hq, hkv, d, bs, dtype)
    flops = 4 * hq * d * n * n / 2
    tflops = lambda ms: flops / ms / 1e9  # noqa: E731
    ms = time_attention(*tensors, n, n)
    # What the engine launches for a prompt: its own keys read from the step's K/V rows (chunk_kv).
    _, kv_cache, block_table = tensors[:3]
    rows = [kv_cache[i][block_table[0].long()].flatten(0, 1)[:n].contiguous() for i in range(2)]
    ms_rows = time_attention(*tensors, n, n, chunk_kv=tuple(rows))
    q = torch.randn(1, hq, n, d, device="cuda", dtype=dtype)
    k = torch.randn(1, hkv, n, d, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    sdpa = gpu_time_ms(
        lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    )
    print(f"triton paged (default {default_config(d, hq // hkv, n)}) {ms * 1e3:8.1f} us {tflops(ms):6.1f} TFLOP/s"
          f" | keys from the step's rows {ms_rows * 1e3:8.1f} us {tflops(ms_rows):6.1f} TFLOP/s"
          f" | torch SDPA {sdpa * 1e3:8.1f} us {tflops(sdpa):6.1f} TFLOP/s", flush=True)
    results["prefill"] = {"tokens": n, "us": ms * 1e3, "rows_us": ms_rows * 1e3,
                          "sdpa_us": sdpa * 1e3}
    if args.sweep:
        def sweep(label: str, shapes, default_ms: float) -> dict:
            best = (default_ms, "default")
            for block_m, tile_n, warps, stages in shapes:
                cfg = KernelConfig(block_m=block_m, tile_n=tile_n, num_warps=warps, num_stages=stages)
                try:
                    t = time_attention(*tensors, n, n, config=cfg, chunk_kv=tuple(rows))
                except Exception as exc:  # out of shared memory or registers
                    print(f"   {label}bm {block_m} tn {tile_n} w {warps} s {stages}: {type(exc).__name__}")
                    continue
                print(f"   {label}bm {block_m:3d} tn {tile_n:3d} w {warps} s {stages}: {t * 1e3:7.1f} us {tflops(t):6.1f} TFLOP/s")
                best = min(best, (t, f"bm {block_m} tn {tile_n} w {warps} s {stages}"), key=lambda x: x[0])
            print(f"   {label}prefill sweep best: {best[0] * 1e3:8.1f} us {tflops(best[0]):6.1f} TFLOP/s with {best[1]}")
            return {"us": best[0] * 1e3, "cfg": best[1]}

        results["prefill"]["best"] = sweep("", itertools.product((32, 64, 128, 256), (32, 64, 128), (4, 8), (2, 3)),
                                           ms_rows)
    tensors = None


def _write(path: str, results: dict) -> None:
    try:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
    except OSError:
        pass


if __name__ == "__main__":
    main()
