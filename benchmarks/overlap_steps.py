"""Prompt chunks and decode steps on two CUDA streams: do the prompt's products run under the decode's KV reads?

    python benchmarks/overlap_steps.py --model llama --decode 256:1500,128:1500 --prompts 512,1024,2048 --carveouts 0,32

A decode step of a large batch is bound by memory: it reads every weight once and every request's KV
cache. A prompt chunk is bound by its products' arithmetic. Run in one batch (how a mixed step runs
today), each layer's products and its attention still take turns: the chunk's products wait while the
decode's attention streams the cache, and the other way round. Run as two forward passes on two streams,
the device may overlap them. Each case times, from CUDA graphs (random weights, bf16, distinct KV blocks
per request): the decode alone; the prompts alone; both in one mixed batch; both on one stream, one after
the other; both on two streams (the decode's at high priority); and the same with cuBLAS told to leave
N SMs free in the prompt's products (torch's SM carve-out), so that the decode's kernels find room.
"""
from __future__ import annotations

import argparse
import json
import os

import torch

from gpu_measure import make_llm, median_event_ms
from kernel_breakdown import MODELS
from split_decode import decode_batch, graph_of
from pagedllm.attention import AttentionMetadata


def prompt_batch(runner, tokens: int, per_prompt: int, first_block: int) -> dict:
    """Device inputs of ``tokens // per_prompt`` new prompts of ``per_prompt`` tokens over blocks from ``first_block`` on."""
    dev, bs = runner.device, runner.block_size
    reqs = tokens // per_prompt
    nb = -(-per_prompt // bs)
    table = torch.zeros(reqs, runner.max_blocks_per_req, dtype=torch.int32, device=dev)
    table[:, :nb] = (first_block + torch.arange(reqs * nb, dtype=torch.int32, device=dev)).view(reqs, nb)
    pos = torch.arange(per_prompt, device=dev)
    slot = (table[:, pos // bs].long() * bs + pos % bs).reshape(-1)
    return dict(
        input_ids=torch.randint(1000, 100000, (reqs * per_prompt,), device=dev),
        positions=pos.repeat(reqs),
        rows=torch.arange(1, reqs + 1, device=dev) * per_prompt - 1,
        md=AttentionMetadata(
            num_actual_tokens=reqs * per_prompt,
            num_reqs=reqs,
            max_query_len=per_prompt,
            max_seq_len=runner.max_model_len,
            query_start_loc=torch.arange(reqs + 1, dtype=torch.int32, device=dev) * per_prompt,
            seq_lens=torch.full((reqs,), per_prompt, dtype=torch.int32, device=dev),
            block_table=table,
            slot_mapping=slot,
            query_start_loc_cpu=[i * per_prompt for i in range(reqs + 1)],
            seq_lens_cpu=[per_prompt] * reqs,
        ),
    )


def mixed_batch(dec: dict, pre: dict) -> dict:
    """One batch of the decode rows followed by the prompts' rows (the scheduler's order)."""
    a, b = dec["md"], pre["md"]
    n = a.num_actual_tokens
    return dict(
        input_ids=torch.cat([dec["input_ids"], pre["input_ids"]]),
        positions=torch.cat([dec["positions"], pre["positions"]]),
        rows=torch.cat([torch.arange(n, device=pre["rows"].device), pre["rows"] + n]),
        md=AttentionMetadata(
            num_actual_tokens=n + b.num_actual_tokens,
            num_reqs=a.num_reqs + b.num_reqs,
            max_query_len=b.max_query_len,
            max_seq_len=a.max_seq_len,
            query_start_loc=torch.cat([a.query_start_loc, b.query_start_loc[1:] + n]),
            seq_lens=torch.cat([a.seq_lens, b.seq_lens]),
            block_table=torch.cat([a.block_table, b.block_table]),
            slot_mapping=torch.cat([a.slot_mapping, b.slot_mapping]),
            query_start_loc_cpu=a.query_start_loc_cpu + [q + n for q in b.query_start_loc_cpu[1:]],
            seq_lens_cpu=a.seq_lens_cpu + b.seq_lens_cpu,
        ),
    )


def forward(runner, p: dict) -> torch.Tensor:  # -> [R] sampled ids of the batch's output rows
    md = AttentionMetadata(**{k: getattr(p["md"], k) for k in p["md"].__dataclass_fields__ if k != "step_cache"})
    hidden = runner.model(p["input_ids"], p["positions"], runner.kv_caches, md, p.get("rows"))
    return runner.model.compute_logits(hidden, float32=False).argmax(dim=-1)


def set_carveout(sms: int) -> None:
    """cuBLAS products captured after this leave ``sms`` SMs free (0: none)."""
    torch._C._set_sm_carveout_experimental(sms if sms > 0 else None)


def two_streams(runner, dec: dict, pre: dict, carveout: int, hi, lo) -> torch.cuda.CUDAGraph:
    def forked():
        main = torch.cuda.current_stream()
        hi.wait_stream(main)
        lo.wait_stream(main)
        with torch.cuda.stream(hi):
            forward(runner, dec)
        set_carveout(carveout)
        try:
            with torch.cuda.stream(lo):
                forward(runner, pre)
        finally:
            set_carveout(0)
        main.wait_stream(hi)
        main.wait_stream(lo)

    return graph_of(forked)


def time_case(runner, batch: int, ctx: int, tokens: int, per_prompt: int, carveouts: list[int]) -> dict:
    dec, next_block = decode_batch(runner, batch, ctx, 0)
    pre = prompt_batch(runner, tokens, per_prompt, next_block)
    out: dict = {"batch": batch, "ctx": ctx, "prompt_tokens": tokens, "per_prompt": per_prompt}
    reps = 20
    out["decode_ms"] = median_event_ms(graph_of(lambda: forward(runner, dec)).replay, reps)
    out["prompts_ms"] = median_event_ms(graph_of(lambda: forward(runner, pre)).replay, reps)
    out["mixed_ms"] = median_event_ms(graph_of(lambda: forward(runner, mixed_batch(dec, pre))).replay, reps)
    out["serial_ms"] = median_event_ms(graph_of(lambda: (forward(runner, dec), forward(runner, pre))).replay, reps)
    low, high = torch.cuda.Stream.priority_range()
    hi, lo = torch.cuda.Stream(priority=high), torch.cuda.Stream(priority=low)
    same = torch.cuda.Stream(priority=0), torch.cuda.Stream(priority=0)
    out["streams_same_prio_ms"] = median_event_ms(two_streams(runner, dec, pre, 0, *same).replay, reps)
    for c in carveouts:
        if c:
            set_carveout(c)
            try:
                out[f"prompts_carve{c}_ms"] = median_event_ms(graph_of(lambda: forward(runner, pre)).replay, reps)
            finally:
                set_carveout(0)
        out[f"streams_carve{c}_ms"] = median_event_ms(two_streams(runner, dec, pre, c, hi, lo).replay, reps)
    best = min(v for k, v in out.items() if k.startswith("streams_"))
    # The share of the shorter pass hidden under the longer: 1 is perfect overlap, 0 none.
    out["hidden_fraction"] = (out["serial_ms"] - best) / min(out["decode_ms"], out["prompts_ms"])
    out["best_streams_over_mixed"] = best / out["mixed_ms"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", choices=sorted(MODELS), default="llama")
    ap.add_argument("--decode", default="256:1500,128:1500", help="comma-separated BATCH:CONTEXT")
    ap.add_argument("--prompts", default="512,1024,2048", help="comma-separated prompt tokens a step")
    ap.add_argument("--per-prompt", type=int, default=512, help="tokens of each prompt (a chunk of it)")
    ap.add_argument("--carveouts", default="0,32", help="comma-separated SMs left free by the prompt's cuBLAS products")
    ap.add_argument("--blas", choices=["default", "cublas", "cublaslt"], default="default",
                    help="torch's preferred BLAS library for the products (the carve-out is a cuBLASLt setting)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    if args.blas != "default":
        torch.backends.cuda.preferred_blas_library(args.blas)
    llm = make_llm(MODELS[args.model], smoke=False, enforce_eager=True)
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    carveouts = [int(c) for c in args.carveouts.split(",")]
    results = []
    with torch.inference_mode():
        for spec in args.decode.split(","):
            batch, ctx = (int(v) for v in spec.split(":"))
            for tokens in (int(t) for t in args.prompts.split(",")):
                r = time_case(runner, batch, ctx, tokens, min(args.per_prompt, tokens), carveouts)
                results.append(r)
                print(f"{args.model} decode {batch}x{ctx} + prompts {tokens}: "
                      + ", ".join(f"{k[:-3]} {v:.2f}" for k, v in r.items() if k.endswith("_ms"))
                      + f", hidden {r['hidden_fraction']:.2f}, best/mixed {r['best_streams_over_mixed']:.3f}",
                      flush=True)
    with open(os.path.join(args.out, f"overlap_steps_{args.model}_{args.blas}.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
