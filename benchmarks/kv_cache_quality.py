"""What a float8 KV cache or float8 weights cost in accuracy: perplexity and greedy agreement against the model's own dtype.

Runs the default model (Gemma 3 270M) on the CPU over English text that ships with Python (module
docstrings of the standard library and its license), once per ``kv_cache_dtype``:
- perplexity of the text, from prompt logprobs (the prompt's keys and values go through the cache,
  so its rounding shows);
- greedy continuations of prompts cut from the same text: tokens until the first one that differs
  from the reference cache's continuation.
Each entry of ``--cache-dtypes`` is a ``kv_cache_dtype``, optionally followed by ``/METHOD`` for weights
quantized at load (``auto/fp8``: the model's own cache, float8 weights); the first entry is the reference.

    python benchmarks/kv_cache_quality.py [--model PATH] [--dtype float32] [--chunks 8] [--output-json F]
        [--cache-dtypes auto,fp8,fp8_e5m2,auto/fp8,fp8/fp8]
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import json
import math
import os
import sys
import sysconfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

MODULES = ("argparse", "asyncio", "collections", "csv", "dataclasses", "decimal", "email", "fractions", "functools",
           "heapq", "http", "json", "logging", "pathlib", "pickle", "queue", "re", "shutil", "sqlite3", "statistics",
           "string", "subprocess", "tarfile", "textwrap", "threading", "unittest", "urllib", "uuid", "zipfile")


def english_text() -> str:
    """Docstrings of standard modules, then Python's license if this installation carries it."""
    parts = []
    for name in MODULES:
        doc = inspect.getdoc(importlib.import_module(name))
        if doc and len(doc) > 200:
            parts.append(doc)
    lic = os.path.join(sysconfig.get_paths()["stdlib"], "LICENSE.txt")
    if os.path.exists(lic):
        parts.append(open(lic, encoding="utf-8").read())
    return "\n\n".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the default model (Gemma 3 270M GGUF)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--cache-dtypes", default="auto,fp8,fp8_e5m2")
    ap.add_argument("--chunks", type=int, default=8, help="text chunks of --chunk-tokens tokens each")
    ap.add_argument("--chunk-tokens", type=int, default=512)
    ap.add_argument("--continue-tokens", type=int, default=64)
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()

    from pagedllm import LLM, SamplingParams
    from pagedllm.model_loader.default_model import default_model_path

    model = args.model or default_model_path()
    results: dict = {"model": model, "dtype": args.dtype, "chunks": args.chunks, "chunk_tokens": args.chunk_tokens}
    continuations: dict[str, list[list[int]]] = {}
    chunks: list[list[int]] = []
    for config in args.cache_dtypes.split(","):
        cache_dtype, _, quantization = config.partition("/")
        llm = LLM(model=model, dtype=args.dtype, device="cpu", kv_cache_dtype=cache_dtype, enable_prefix_caching=False,
                  quantization=quantization or None)
        if not chunks:
            ids = llm.get_tokenizer().encode(english_text())
            n = args.chunk_tokens
            chunks = [ids[i * n : (i + 1) * n] for i in range(min(args.chunks, len(ids) // n))]
        scored = llm.generate([{"prompt_token_ids": c} for c in chunks],
                              SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False), use_tqdm=False)
        nll, count = 0.0, 0
        for out, chunk in zip(scored, chunks):
            for pos, entry in enumerate(out.prompt_logprobs or []):
                if entry is None:
                    continue  # the first token has no prefix
                nll -= entry[chunk[pos]].logprob
                count += 1
        prompts = [{"prompt_token_ids": c[: len(c) // 2]} for c in chunks]
        greedy = SamplingParams(temperature=0.0, max_tokens=args.continue_tokens, ignore_eos=True, detokenize=False)
        continuations[config] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy, use_tqdm=False)]
        results[config] = {"perplexity": math.exp(nll / count), "scored_tokens": count}
        llm.llm_engine.engine_core.shutdown()
        del llm
    ref_name = args.cache_dtypes.split(",")[0]
    ref = continuations[ref_name]
    print(f"{model}: {len(chunks)} chunks of {args.chunk_tokens} tokens, dtype {args.dtype}")
    print(f"{'cache[/weights]':10s} {'perplexity':>10s} {'vs ' + ref_name:>9s} {'same greedy tokens (mean of prefixes)':>40s}")
    for name, cont in continuations.items():
        same = []
        for a, b in zip(cont, ref):
            k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            same.append(k)
        r = results[name]
        r["greedy_common_prefix_mean"] = sum(same) / len(same)
        r["greedy_identical"] = sum(k == args.continue_tokens for k in same)
        ratio = r["perplexity"] / results[ref_name]["perplexity"]
        print(f"{name:10s} {r['perplexity']:10.3f} {ratio:9.4f}x {r['greedy_common_prefix_mean']:24.1f} of "
              f"{args.continue_tokens} ({r['greedy_identical']}/{len(same)} identical)")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
