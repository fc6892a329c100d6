"""pagedllm vs HF transformers `generate` on the same model, prompts and dtype, in one run (CPU by default).

Workload: 32 prompts of 32-256 random tokens, output lengths drawn from [16, 128] (fixed seed), greedy.
HF runs padded batches to each batch's longest output; both are credited only the requested tokens.

    python benchmarks/compare_hf.py [--model PATH.gguf|DIR] [--hf-batch-size 32] [--output-json F]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time

import torch

# Run as a script from a checkout: import this tree's pagedllm, not whatever an install points to.
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)


def make_workload(n: int, vocab: int, seed: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(1000, vocab) for _ in range(rng.randint(32, 256))] for _ in range(n)]
    outs = [rng.randint(16, 128) for _ in range(n)]
    return prompts, outs


def run_pagedllm(model: str, prompts, out_lens, dtype: str) -> tuple[float, list[list[int]]]:
    from pagedllm import LLM, SamplingParams

    llm = LLM(model=model, dtype=dtype, device="cpu")
    params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for o in out_lens]
    llm.generate([{"prompt_token_ids": prompts[0]}], params[0], use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - t0, [o.outputs[0].token_ids for o in outs]


def load_hf(model: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    if model.endswith(".gguf"):
        d, f = os.path.split(os.path.abspath(model))
        return AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=dtype).eval()
    return AutoModelForCausalLM.from_pretrained(model, dtype=dtype).eval()


def run_hf(hf, prompts, out_lens, batch_size: int) -> tuple[float, list[list[int]]]:
    pad = 0
    results: list[list[int]] = []
    with torch.no_grad():
        hf.generate(torch.tensor([prompts[0]]), max_new_tokens=2, do_sample=False, pad_token_id=pad)  # warm-up
        t0 = time.perf_counter()
        for s in range(0, len(prompts), batch_size):
            batch, lens = prompts[s : s + batch_size], out_lens[s : s + batch_size]
            width = max(len(p) for p in batch)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])  # left padding
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            out = hf.generate(
                ids, attention_mask=mask, do_sample=False, max_new_tokens=max(lens), min_new_tokens=max(lens),
                eos_token_id=None, pad_token_id=pad,
            )
            results += [out[i, width : width + lens[i]].tolist() for i in range(len(batch))]
        return time.perf_counter() - t0, results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the Gemma 3 270M GGUF")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--hf-batch-size", type=int, default=32)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    if args.model is None:
        from pagedllm.model_loader.default_model import default_model_path

        args.model = default_model_path()
    dtype = getattr(torch, args.dtype)
    hf = load_hf(args.model, dtype)
    prompts, out_lens = make_workload(args.num_prompts, hf.config.get_text_config().vocab_size, args.seed)
    useful = sum(out_lens)
    hf_s, hf_tokens = run_hf(hf, prompts, out_lens, args.hf_batch_size)
    del hf
    ours_s, our_tokens = run_pagedllm(args.model, prompts, out_lens, args.dtype)
    same = sum(a == b for a, b in zip(hf_tokens, our_tokens))
    res = {
        "model": os.path.basename(args.model),
        "machine": f"{platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads",
        "num_prompts": len(prompts),
        "useful_output_tokens": useful,
        "hf_seconds": hf_s,
        "pagedllm_seconds": ours_s,
        "hf_output_tok_per_s": useful / hf_s,
        "pagedllm_output_tok_per_s": useful / ours_s,
        "ratio": hf_s / ours_s,
        "identical_sequences": same,
    }
    print(json.dumps(res, indent=2))
    print(f"\n{'engine':12s} {'seconds':>9s} {'out tok/s':>10s}")
    print(f"{'HF generate':12s} {hf_s:9.2f} {useful / hf_s:10.1f}")
    print(f"{'pagedllm':12s} {ours_s:9.2f} {useful / ours_s:10.1f}")
    print(f"ratio pagedllm / HF: {hf_s / ours_s:.2f}x; identical greedy sequences: {same}/{len(prompts)}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
