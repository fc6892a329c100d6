"""H200 benchmarks of pagedllm, with HF transformers (static cache) in the same run: the issue's four workloads.

  1. Qwen3-0.6B shape, 256 prompts, input and output lengths uniform in [100, 1024] (seed 0): output tok/s;
     plus the first --hf-prompts of them through pagedllm and through HF generate(cache_implementation="static").
  2. Llama-3-8B shape, 256 prompts, 1000 in / 1000 out: output tok/s and the decode-step roofline fraction
     (weight bytes + KV bytes read per step) / step time / device-to-device copy bandwidth measured here.
  3. Llama-3-8B, batch 1: time per output token (CUDA graphs, and eager for comparison).
  4. Llama-3-8B start-to-ready (LLM() constructor, cold Triton cache) with the worker's phase breakdown.

Random weights (--load-format dummy), bf16, greedy, EOS ignored. Each model runs in its own process, so the
GPU is clean and the 8B start is a real cold start. Usage:

    python benchmarks/h200_throughput.py --out DIR [--sections qwen,llama,hf] [--hf-prompts 32]

Writes DIR/<section>.json and DIR/summary.json; prints a table last. --smoke runs everything tiny (CPU ok).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from types import MappingProxyType

HERE = os.path.dirname(os.path.abspath(__file__))
SHAPES = os.path.join(HERE, "shapes")
QWEN = os.path.join(SHAPES, "qwen3-0.6b")
LLAMA = os.path.join(SHAPES, "llama-3-8b")


from gpu_measure import (  # noqa: E402 - a sibling module of this script
    workload_fixed,
    workload_qwen,
    StepRecorder,
    copy_bandwidth_bytes_per_s,
    decode_profile,
    decode_roofline,
    kernel_profile,
    print_decode_profile,
    make_llm,
    run_generate,
    startup_report,
    warm_up,
    weight_bytes_read,
)


# ---- sections ------------------------------------------------------------------------------------------
def _save(args, name: str, out: dict) -> None:
    """Partial results after every stage: a crash or time-out later keeps what finished."""
    with open(os.path.join(args.out, f"{name}.json"), "w") as f:
        json.dump(out, f, indent=2, default=str)


def section_qwen(args) -> dict:
    out: dict = {"copy_bw_bytes_per_s": copy_bandwidth_bytes_per_s()}
    t0 = time.perf_counter()
    llm = make_llm(QWEN if not args.smoke else args.smoke_model, args.smoke)
    out["startup_s"] = time.perf_counter() - t0
    out["startup"] = startup_report(llm)
    _save(args, "qwen", out)
    vocab = llm.llm_engine.config.model_config.vocab_size
    n, hi = (256, 1024) if not args.smoke else (12, 60)
    reqs = workload_qwen(vocab, n=n, lo=min(100, hi // 2), hi=hi)
    warm_up(llm)
    rec = StepRecorder(llm)
    out["workload1"] = run_generate(llm, reqs, rec)
    mc = llm.llm_engine.config.model_config
    out["workload1"]["decode"] = decode_roofline(
        rec.steps, weight_bytes_read(llm), mc.kv_bytes_per_token(), out["copy_bw_bytes_per_s"], len(reqs)
    )
    _save(args, "qwen", out)
    # Where workload 1's decode time goes, from a second run with each step's device time recorded.
    rec = StepRecorder(llm, device_times=True)
    out["workload1_timed"] = run_generate(llm, reqs, rec)
    out["workload1_timed"]["profile"] = decode_profile(rec.steps, mc.kv_bytes_per_token(), out["copy_bw_bytes_per_s"])
    print(f"workload 1 with device timing: {out['workload1_timed']['output_tok_per_s']:.0f} tok/s")
    print_decode_profile(out["workload1_timed"]["profile"])
    _save(args, "qwen", out)
    subset = reqs[: args.hf_prompts]
    out["subset"] = run_generate(llm, subset)
    out["subset"]["requested_output_tokens"] = sum(o for _, o in subset)
    return out


def section_llama(args) -> dict:
    out: dict = {"copy_bw_bytes_per_s": copy_bandwidth_bytes_per_s()}
    t0 = time.perf_counter()
    llm = make_llm(LLAMA if not args.smoke else args.smoke_model, args.smoke)
    out["startup_s"] = time.perf_counter() - t0  # workload 4
    out["process_to_ready_s"] = time.time() - args.process_t0
    out["startup"] = startup_report(llm)
    _save(args, "llama", out)
    from pagedllm.entrypoints.bench.latency import measure_latency

    in_len, out_len = (1000, 256) if not args.smoke else (20, 8)
    out["batch1"] = measure_latency(llm, 1, in_len, out_len, num_iters=2, num_warmup=1)  # workload 3
    _save(args, "llama", out)

    vocab = llm.llm_engine.config.model_config.vocab_size
    warm_up(llm)
    n, il, ol = (256, 1000, 1000) if not args.smoke else (12, 40, 30)
    reqs = workload_fixed(vocab, n, il, ol)
    rec = StepRecorder(llm)
    out["workload2"] = run_generate(llm, reqs, rec)  # workload 2
    mc = llm.llm_engine.config.model_config
    out["weight_bytes_read"] = weight_bytes_read(llm)
    out["kv_bytes_per_token"] = mc.kv_bytes_per_token()
    out["workload2"]["decode"] = decode_roofline(
        rec.steps, out["weight_bytes_read"], mc.kv_bytes_per_token(), out["copy_bw_bytes_per_s"], n
    )
    rec.enabled = False
    _save(args, "llama", out)

    # Diagnostics: batch 1 without graphs, and where a batch-1 step's device time goes.
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    if runner.use_cuda_graphs:
        runner.use_cuda_graphs = False
        try:
            out["batch1_eager"] = measure_latency(llm, 1, in_len, min(out_len, 64), num_iters=1, num_warmup=0)
        finally:
            runner.use_cuda_graphs = True
        _save(args, "llama", out)
    if not args.smoke:
        for eager in (True, False):
            key = f"profile_b1_{'eager' if eager else 'graph'}"
            try:
                out[key] = kernel_profile(llm, 1, 32, 16, eager)
            except Exception as e:  # noqa: BLE001 - a diagnostic must not sink the section
                out[key] = {"error": repr(e)}
            _save(args, "llama", out)
    return out


def section_hf(args) -> dict:
    """HF transformers generate with a static cache on the first --hf-prompts prompts of workload 1.

    Two identical calls: the first pays for HF's automatic compilation of the static-cache forward, the
    second is warm (HF's steady state, the number compared against). Partial results are written after
    each call, so a time-out keeps what finished.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    model_dir = QWEN if not args.smoke else args.smoke_model
    cfg = AutoConfig.from_pretrained(model_dir)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.eval()
    n, hi = (256, 1024) if not args.smoke else (12, 60)
    reqs = workload_qwen(cfg.vocab_size, n=n, lo=min(100, hi // 2), hi=hi)[: args.hf_prompts]
    max_in = max(len(p) for p, _ in reqs)
    max_out = max(o for _, o in reqs)
    ids = torch.zeros(len(reqs), max_in, dtype=torch.long)
    mask = torch.zeros(len(reqs), max_in, dtype=torch.long)
    for i, (p, _) in enumerate(reqs):  # left padding, as HF batched generation wants
        ids[i, max_in - len(p):] = torch.tensor(p)
        mask[i, max_in - len(p):] = 1
    ids, mask = ids.to(dev), mask.to(dev)
    model.generation_config.eos_token_id = None  # EOS ignored: every row runs max_out steps
    model.generation_config.pad_token_id = 0
    useful = sum(o for _, o in reqs)
    out = {
        "mode": 'generate(cache_implementation="static"), one batch, left-padded, greedy, EOS ignored',
        "num_prompts": len(reqs),
        "max_input_len": max_in,
        "batch_steps": max_out,
        "useful_output_tokens": useful,
    }
    path = os.path.join(args.out, "hf.json")
    for name in ("cold", "warm"):
        if dev == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.inference_mode():
            gen = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=max_out, do_sample=False,
                cache_implementation="static",
            )
        if dev == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        if gen.shape[1] - max_in != max_out:
            raise RuntimeError(f"HF generated {gen.shape[1] - max_in} steps, expected {max_out}")
        out[f"{name}_wall_s"] = wall
        out[f"useful_tok_per_s_{name}"] = useful / wall
        with open(path, "w") as f:
            json.dump(out, f, indent=2)
    return out


SECTIONS = MappingProxyType({"qwen": section_qwen, "llama": section_llama, "hf": section_hf})


# ---- driver --------------------------------------------------------------------------------------------
def _fmt(x, spec=".1f"):
    return "n/a" if x is None or (isinstance(x, float) and x != x) else format(x, spec)


def summarize(res: dict) -> dict:
    q, l, h = res.get("qwen", {}), res.get("llama", {}), res.get("hf", {})
    s: dict = {}
    if "workload1" in q:
        s["w1_output_tok_per_s"] = q["workload1"]["output_tok_per_s"]
    if "subset" in q:
        s["subset_pagedllm_tok_per_s"] = q["subset"]["output_tok_per_s"]
        for name in ("cold", "warm"):
            hf = h.get(f"useful_tok_per_s_{name}")
            if hf:
                s[f"subset_hf_tok_per_s_{name}"] = hf
                s[f"ratio_vs_hf_{name}"] = q["subset"]["output_tok_per_s"] / hf
    if "workload2" in l:
        s["w2_output_tok_per_s"] = l["workload2"]["output_tok_per_s"]
        d = l["workload2"].get("decode", {})
        s["w2_roofline_runner"] = d.get("roofline_runner_all")
        s["w2_roofline_step"] = d.get("roofline_step_all")
    if "batch1" in l:
        s["w3_tpot_ms"] = l["batch1"]["tpot_ms"]
    if "batch1_eager" in l:
        s["w3_tpot_ms_eager"] = l["batch1_eager"]["tpot_ms"]
    if "startup_s" in l:
        s["w4_start_to_ready_s"] = l["startup_s"]
        s["w4_phases_s"] = l["startup"]["phases_s"]
    return s


def print_table(res: dict, s: dict) -> None:
    q, l = res.get("qwen", {}), res.get("llama", {})
    bw = l.get("copy_bw_bytes_per_s") or q.get("copy_bw_bytes_per_s")
    print(f"\ncopy bandwidth (read+write): {_fmt(bw and bw / 1e12, '.2f')} TB/s")
    for name in ("qwen", "llama", "hf"):
        for key in ("error", "timeout"):
            if key in res.get(name, {}):
                print(f"[{name}] {key.upper()}: {res[name][key][-600:]}")
    rows = [
        ("1 Qwen3-0.6B 256 prompts in/out U[100,1024] out tok/s", s.get("w1_output_tok_per_s"), ">= 30000"),
        ("1 subset: pagedllm out tok/s", s.get("subset_pagedllm_tok_per_s"), ""),
        ("1 subset: HF static-cache out tok/s (warm / cold)",
         f"{_fmt(s.get('subset_hf_tok_per_s_warm'))} / {_fmt(s.get('subset_hf_tok_per_s_cold'))}", ""),
        ("1 subset: ratio vs HF (warm / cold)",
         f"{_fmt(s.get('ratio_vs_hf_warm'))}x / {_fmt(s.get('ratio_vs_hf_cold'))}x", ">= 20x"),
        ("2 Llama-3-8B 256 x 1000/1000 out tok/s", s.get("w2_output_tok_per_s"), ">= 12000"),
        ("2 decode roofline fraction (runner / whole step)",
         f"{_fmt(s.get('w2_roofline_runner'), '.2f')} / {_fmt(s.get('w2_roofline_step'), '.2f')}", ">= 0.70"),
        ("3 Llama-3-8B batch-1 ms/token (graphs / eager)",
         f"{_fmt(s.get('w3_tpot_ms'), '.3f')} / {_fmt(s.get('w3_tpot_ms_eager'), '.3f')}", "<= 4.3"),
        ("4 Llama-3-8B start-to-ready s", s.get("w4_start_to_ready_s"), "<= 30"),
    ]
    print(f"{'workload':58s} {'measured':>22s} {'target':>10s}")
    for name, val, target in rows:
        val = val if isinstance(val, str) else _fmt(val)
        print(f"{name:58s} {val:>22s} {target:>10s}")
    if "w4_phases_s" in s:
        print("  start-up phases: " + ", ".join(f"{k} {v:.2f}s" for k, v in s["w4_phases_s"].items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--sections", default="qwen,llama,hf")
    ap.add_argument("--hf-prompts", type=int, default=32)
    ap.add_argument("--budget-s", type=float, default=480.0, help="wall budget; the HF section gets what is left")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, CPU ok: checks the script itself")
    ap.add_argument("--smoke-model", default=None)
    ap.add_argument("--section", default=None, help=argparse.SUPPRESS)  # internal: run one section here
    ap.add_argument("--process-t0", type=float, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)

    if args.section:
        args.process_t0 = args.process_t0 or time.time()
        res = SECTIONS[args.section](args)
        with open(os.path.join(args.out, f"{args.section}.json"), "w") as f:
            json.dump(res, f, indent=2, default=str)
        return

    t_start = time.time()
    results: dict = {}
    for name in [s for s in args.sections.split(",") if s]:
        env = dict(os.environ)
        if name == "llama":
            # A cold Triton cache: start-to-ready as on a fresh machine.
            env["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-cold-")
        left = args.budget_s - (time.time() - t_start)
        cmd = [sys.executable, os.path.abspath(__file__), "--section", name, "--out", args.out,
               "--hf-prompts", str(args.hf_prompts), "--process-t0", str(time.time())]
        if args.smoke:
            cmd += ["--smoke", "--smoke-model", args.smoke_model]
        print(f"== section {name} (budget left {left:.0f} s)", flush=True)
        partial = os.path.join(args.out, f"{name}.json")
        try:
            proc = subprocess.run(cmd, env=env, timeout=max(left, 30), capture_output=True, text=True)
            with open(os.path.join(args.out, f"{name}.log"), "w") as f:
                f.write(proc.stdout + proc.stderr)
            results[name] = json.load(open(partial)) if os.path.exists(partial) else {}
            if proc.returncode != 0:
                results[name]["error"] = (proc.stdout + proc.stderr)[-3000:]
        except subprocess.TimeoutExpired as e:
            results[name] = json.load(open(partial)) if os.path.exists(partial) else {}
            results[name]["timeout"] = f"timed out after {e.timeout:.0f} s"
    summary = summarize(results)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump({"summary": summary, "results": results}, f, indent=2, default=str)
    print_table(results, summary)


if __name__ == "__main__":
    main()
