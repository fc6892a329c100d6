"""Decode steps split into sub-batches on separate CUDA streams: does one half's attention overlap the other's products?

    python benchmarks/split_decode.py --model qwen --cases 256:640,256:1000,128:800,64:1000 --splits 1,2

A decode step runs its ~270 kernels one after another: the latency-bound matrix products (a few µs
each, most SMs idle at M <= 256) and the bandwidth-bound attention never run at once. Split the batch
into S independent sub-batches, each a whole forward pass on its own stream, and the device may run one
sub-batch's products while another's attention streams the KV cache. Each case times the forward plus
the lm_head and argmax, captured into one CUDA graph (random weights, bf16, distinct KV blocks per
request) as: one batch; S sub-batches one after another on one stream; S sub-batches on S streams.
"""
from __future__ import annotations

import argparse
import json
import os

import torch

from gpu_measure import make_llm, median_event_ms
from kernel_breakdown import MODELS
from pagedllm.attention import AttentionMetadata


def decode_batch(runner, batch: int, ctx: int, first_block: int) -> tuple[dict, int]:  # (inputs, next free block)
    """Device inputs of ``batch`` one-token requests at context ``ctx`` over blocks from ``first_block`` on."""
    dev, bs = runner.device, runner.block_size
    nb = -(-ctx // bs)
    table = torch.zeros(batch, runner.max_blocks_per_req, dtype=torch.int32, device=dev)
    table[:, :nb] = (first_block + torch.arange(batch * nb, dtype=torch.int32, device=dev)).view(batch, nb)
    slot = table[:, (ctx - 1) // bs].long() * bs + (ctx - 1) % bs
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    inputs = dict(
        input_ids=torch.randint(1000, 100000, (batch,), device=dev),
        positions=torch.full((batch,), ctx - 1, dtype=torch.int64, device=dev),
        md=AttentionMetadata(
            num_actual_tokens=batch,
            num_reqs=batch,
            max_query_len=1,
            max_seq_len=runner.max_model_len,
            query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=dev),
            seq_lens=seq_lens,
            block_table=table,
            slot_mapping=slot,
            query_start_loc_cpu=list(range(batch + 1)),
            seq_lens_cpu=[ctx] * batch,
            decode_order=torch.arange(batch, dtype=torch.int32, device=dev),
        ),
    )
    return inputs, first_block + batch * nb


def step(runner, parts: list[dict]) -> list[torch.Tensor]:  # -> per sub-batch [B_i] sampled ids
    model = runner.model
    outs = []
    for p in parts:
        md = AttentionMetadata(**{k: getattr(p["md"], k) for k in p["md"].__dataclass_fields__ if k != "step_cache"})
        hidden = model(p["input_ids"], p["positions"], runner.kv_caches, md)
        outs.append(model.compute_logits(hidden, float32=False).argmax(dim=-1))
    return outs


def graph_of(fn) -> torch.cuda.CUDAGraph:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    return g


def time_case(runner, batch: int, ctx: int, splits: int, priorities: bool) -> dict:
    whole, _ = decode_batch(runner, batch, ctx, 0)
    sub = batch // splits
    # Sub-batch i holds rows i*sub.. of the whole batch: the same requests over the same blocks.
    parts = [decode_batch(runner, sub, ctx, i * sub * (-(-ctx // runner.block_size)))[0] for i in range(splits)]
    for i, p in enumerate(parts):
        p["input_ids"] = whole["input_ids"][i * sub : (i + 1) * sub]
    out: dict = {"batch": batch, "ctx": ctx, "splits": splits}
    if splits == 1:
        g = graph_of(lambda: step(runner, [whole]))
        out["one_batch_ms"] = median_event_ms(g.replay, 30)
        return out
    g = graph_of(lambda: step(runner, parts))
    out["serial_ms"] = median_event_ms(g.replay, 30)
    lo, hi = torch.cuda.Stream.priority_range()
    streams = [torch.cuda.Stream(priority=(hi if priorities and i == 0 else 0)) for i in range(splits)]

    def forked():
        main = torch.cuda.current_stream()
        for s, p in zip(streams, parts):
            s.wait_stream(main)
            with torch.cuda.stream(s):
                step(runner, [p])
        for s in streams:
            main.wait_stream(s)

    g2 = graph_of(forked)
    out["streams_ms"] = median_event_ms(g2.replay, 30)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", choices=sorted(MODELS), default="qwen")
    ap.add_argument("--cases", default="256:640,256:1000,128:800,64:1000", help="comma-separated BATCH:CONTEXT")
    ap.add_argument("--splits", default="1,2", help="comma-separated sub-batch counts (1: the whole batch)")
    ap.add_argument("--priorities", action="store_true", help="the first sub-batch's stream at high priority")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    llm = make_llm(MODELS[args.model], smoke=False, enforce_eager=True)
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    results = []
    with torch.inference_mode():
        for spec in args.cases.split(","):
            batch, ctx = (int(v) for v in spec.split(":"))
            row = {}
            for s in (int(v) for v in args.splits.split(",")):
                r = time_case(runner, batch, ctx, s, args.priorities)
                results.append(r)
                row.update({f"{k}@{s}": v for k, v in r.items() if k.endswith("_ms")})
            print(f"{args.model} batch {batch} ctx {ctx}: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items()), flush=True)
    with open(os.path.join(args.out, f"split_decode_{args.model}.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
