"""What each quantized format costs in accuracy on the real Gemma 3 270M: perplexity of a shipped public-domain text
under pagedllm and under the reference implementation, for float32 and each format.

The checkpoints (float32, w8a8, w8a8-rtn, w8a8-asym, gptq-4b-g128, awq-4b-g128, rtn-4b-g128) are made (and cached) by
``tests/gemma_quant_checkpoints.py``; the text is
``benchmarks/data/declaration_gettysburg.txt`` read as one sequence. The reference is transformers loading the
float checkpoint, or the format's dequantized float checkpoint (GPTQ, AWQ), or compressed-tensors' own model of
the checkpoint (W8A8: decompressed weights, activations quantized by its forward). GPTQ and AWQ follow
``GPTQ_RECIPE`` and ``AWQ_RECIPE`` of that file (GPTQ: 16k calibration tokens, act-order). Making all from an
empty cache takes about 15 minutes on two CPU cores (GPTQ about 2, AWQ about 1.5), scoring each about a minute.
Prints a table: perplexity, ratio to float32, pagedllm against the reference, and with ``--decode-tokens N``
pagedllm's milliseconds per output token at batch 1 on this machine's CPU (greedy, a 32-token prompt, the time
of N tokens less that of one, over N - 1; the median of three); ``--output-json`` writes the same numbers.

    PYTHONPATH=$PWD python benchmarks/quant_quality.py [--formats float32,w8a8,gptq-4b-g128]
        [--tokens N] [--decode-tokens N] [--output-json F]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (REPO, os.path.join(REPO, "tests")):
    if p not in sys.path:
        sys.path.insert(0, p)


def reference_model(name: str, path: str, ref: str | None, float_dir: str):
    import torch
    from transformers import AutoModelForCausalLM

    import quant_checkpoints as qc

    if name.startswith("w8a8"):
        return qc.ct_reference_model(path, float_dir)
    return AutoModelForCausalLM.from_pretrained(ref or path, dtype=torch.float32).eval()


def decode_ms(llm, n: int) -> float:
    """Milliseconds per output token at batch 1: (time of n greedy tokens - time of one) / (n - 1), median of 3."""
    from pagedllm import SamplingParams

    prompt = [{"prompt_token_ids": list(range(10, 42))}]

    def run(tokens: int) -> float:
        start = time.perf_counter()
        llm.generate(prompt, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - start

    run(n)  # warm-up
    return statistics.median((run(n) - run(1)) / (n - 1) * 1000 for _ in range(3))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="float32,w8a8,w8a8-rtn,w8a8-asym,gptq-4b-g128,awq-4b-g128,rtn-4b-g128")
    ap.add_argument("--tokens", type=int, default=None, help="score only the text's first N tokens")
    ap.add_argument("--decode-tokens", type=int, default=0, help="also time batch-1 decoding over N tokens (N >= 2)")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()

    import gemma_quant_checkpoints as gq
    import perplexity as pp

    names = args.formats.split(",")
    unknown = [n for n in names if n not in gq.MAKERS]
    if unknown:
        raise SystemExit(f"--formats: unknown format(s) {unknown}; known: {sorted(gq.MAKERS)}")
    checkpoints = gq.make_all(names)
    float_dir = gq.float_model()
    ids = pp.text_ids(float_dir, args.tokens)
    results: dict = {"text": os.path.relpath(pp.TEXT, REPO), "tokens": len(ids), "formats": {}}
    for name in names:
        path, ref = checkpoints[name]
        llm = pp.pagedllm_llm(path, max_model_len=len(ids) + 8)
        ours = pp.pagedllm_perplexity(llm, ids)
        ms = decode_ms(llm, args.decode_tokens) if args.decode_tokens >= 2 else None
        llm.llm_engine.engine_core.shutdown()
        del llm
        theirs = pp.hf_perplexity(reference_model(name, path, ref, float_dir), ids)
        results["formats"][name] = {"pagedllm": ours, "reference": theirs}
        if ms is not None:
            results["formats"][name]["decode_ms_per_token"] = ms
    base = results["formats"].get("float32", {}).get("reference") or pp.hf_perplexity(
        reference_model("float32", float_dir, None, float_dir), ids)
    print(f"Gemma 3 270M, {results['text']}: {len(ids)} tokens")
    print(f"{'format':14s} {'pagedllm':>9s} {'reference':>9s} {'ours/ref':>9s} {'vs float32':>10s} {'ms/token':>9s}")
    for name, r in results["formats"].items():
        r["pagedllm_vs_reference"] = r["pagedllm"] / r["reference"]
        if base:
            r["vs_float32"] = r["pagedllm"] / base
        print(f"{name:14s} {r['pagedllm']:9.3f} {r['reference']:9.3f} {r['pagedllm_vs_reference']:9.4f} "
              f"{r.get('vs_float32', float('nan')):9.3f}x {r.get('decode_ms_per_token', float('nan')):9.1f}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
