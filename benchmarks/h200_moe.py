"""H200 benchmarks of the MoE models: Qwen3-30B-A3B shape in bf16 against HF transformers, Mixtral-8x7B with float8 experts.

Sections, each in its own process (a clean GPU each), in this order:

  qwen     Qwen3-30B-A3B shape (48 layers, 128 experts, top-8), bf16: batch-1 time per output token against its
           floor (the bytes of the parameters one token reads: all but the embedding's unused rows, with the
           top-k experts of each layer only, at the device-to-device copy rate); --prompts prompts of
           --input-len in / --output-len out (default 256 x 1000/1000): output tok/s and the decode roofline
           fraction (bytes of the non-expert weights + the experts the step's tokens touch + KV read, over the
           step's time, at the copy rate); and the first --hf-prompts prompts with --hf-output-len outputs,
           the run HF makes (by default all 256 prompts, 32 new tokens each).
  hf       HF transformers on the same shape and prompts, in its best mode that fits the time: ``generate``
           with its default (dynamic) cache and its default experts implementation (``grouped_mm`` where
           torch has it), bf16, one batch of the largest size that fits (--hf-prompts, halved on running out of
           memory). ``--hf-mode static`` takes the static cache (compiled at first use: minutes at this size).
           Timed warm: prefill + decode, then prefill alone (1 new token). HF makes short outputs because the
           whole workload would take it many minutes; the comparison is made twice: on that run (same prompts
           and lengths through pagedllm and HF), and over the whole workload with HF's time projected as
           ceil(prompts / its batch) batches of (its measured prefill + (output-len - 1) x its measured decode
           step). The step is measured over the shortest contexts of the run, so the projection is HF's best
           case and the ratio a lower bound.
  mixtral  Mixtral-8x7B shape (93 GB in bf16) with ``quantization="fp8"``: float8 experts and linears, loaded in
           bf16 and rounded at load; batch-1 time per output token against its floor, and the --prompts
           workload's output tok/s and decode roofline fraction (pagedllm only).

Random weights (--load-format dummy), greedy, EOS ignored. The expert bytes a decode step of B tokens touches
are estimated per layer as E (1 - (1 - k/E)^B) experts, the expectation under uniform routing. Usage:

    python benchmarks/h200_moe.py --out DIR [--sections qwen,hf,mixtral] [--layers N] [--budget-s 290]

``--layers N`` shortens both models to N layers (the table says so); the default is the real shape. Writes
DIR/<section>.json (partial results after every stage) and DIR/summary.json, prints a table last.
``--smoke`` runs every section on tiny MoE configs of the same families on the CPU: checks the script itself.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from types import MappingProxyType

HERE = os.path.dirname(os.path.abspath(__file__))
SHAPES = os.path.join(HERE, "shapes")
SHAPE_DIRS = MappingProxyType({"qwen": os.path.join(SHAPES, "qwen3-30b-a3b"),
                               "mixtral": os.path.join(SHAPES, "mixtral-8x7b")})
# Tiny configs of the same families for --smoke: a few layers, experts and dimensions, CPU-sized.
SMOKE_OVERRIDES = MappingProxyType({
    "qwen": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, num_hidden_layers=2,
                 max_window_layers=2, vocab_size=512),
    "mixtral": dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                    num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=2, vocab_size=512),
})

from gpu_measure import (  # noqa: E402 - a sibling module of this script
    StepRecorder,
    copy_bandwidth_bytes_per_s,
    make_llm,
    run_generate,
    startup_report,
    warm_up,
    workload_fixed,
)


# ---- model shapes and byte counts ----------------------------------------------------------------------
def model_dir(family: str, args) -> str:
    """The shape's folder, or a copy of its config with fewer layers (--layers) or tiny dims (--smoke)."""
    src = SHAPE_DIRS[family]
    overrides = dict(SMOKE_OVERRIDES[family]) if args.smoke else {}
    if args.layers:
        overrides["num_hidden_layers"] = args.layers
        if family == "qwen":
            overrides["max_window_layers"] = args.layers
    if not overrides:
        return src
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(overrides)
    dst = os.path.join(args.out, f"config-{family}")
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    return dst


def expected_touched(num_experts: int, top_k: int, tokens: int) -> float:
    """Distinct experts ``tokens`` tokens choose in one layer, each taking ``top_k`` of ``num_experts`` at random."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def moe_bytes(llm) -> dict:
    """The model's bytes split as a decode step reads them: the non-expert weights it always reads (the input
    embedding excluded when untied: only its rows for the step's tokens are read), and one expert's bytes
    (weights and scales) per MoE layer."""
    from pagedllm.layers.fused_moe import MoEExperts

    model = llm.llm_engine.engine_core.executor.worker.model_runner.model
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    emb = model.model.embed_tokens.weight
    if not getattr(model, "tie_word_embeddings", False):
        total -= emb.numel() * emb.element_size()
    layers = [m for m in model.modules() if isinstance(m, MoEExperts)]
    if not layers:
        raise ValueError("moe_bytes: the model has no MoE layers")
    expert_params = 0
    per_expert = 0
    for m in layers:
        tensors = [m.w13_weight, m.w2_weight, m.w13_weight_scale, m.w2_weight_scale]
        layer_bytes = sum(t.numel() * t.element_size() for t in tensors if t is not None)
        expert_params += sum(t.numel() * t.element_size() for t in (m.w13_weight, m.w2_weight))
        per_expert = max(per_expert, layer_bytes // m.num_local_experts)
    first = layers[0]
    return {
        "dense_bytes": total - expert_params,
        "expert_bytes": per_expert,
        "moe_layers": len(layers),
        "num_experts": first.num_local_experts,
        "top_k": first.top_k,
        "expert_dtype": str(first.w13_weight.dtype),
    }


def step_bytes(b: dict, tokens: int, ctx: int, kv_bytes_per_token: int) -> float:
    """Bytes a decode step of ``tokens`` tokens over ``ctx`` cached tokens reads, under uniform routing."""
    touched = expected_touched(b["num_experts"], b["top_k"], tokens)
    return b["dense_bytes"] + b["moe_layers"] * touched * b["expert_bytes"] + ctx * kv_bytes_per_token


def moe_decode_roofline(steps: list[dict], b: dict, kv_bytes_per_token: int, bw: float, full_batch: int) -> dict:
    """Roofline fraction of the pure-decode steps: bytes read (``step_bytes``) over their time, at ``bw``."""
    dec = [s for s in steps if s["tokens"] == s["reqs"]]
    if not dec:
        return {}

    def frac(sel, key):
        if not sel:
            return None
        moved = sum(step_bytes(b, s["tokens"], s["ctx"], kv_bytes_per_token) for s in sel)
        return moved / sum(s[key] for s in sel) / bw

    full = [s for s in dec if s["reqs"] == full_batch]
    return {
        "decode_steps": len(dec),
        "full_batch_steps": len(full),
        "roofline_runner_all": frac(dec, "runner_s"),
        "roofline_step_all": frac(dec, "step_s"),
        "roofline_step_full_batch": frac(full, "step_s"),
        "median_step_ms_full_batch": 1e3 * sorted(s["step_s"] for s in full)[len(full) // 2] if full else None,
        "decode_time_s": sum(s["step_s"] for s in dec),
        "all_step_time_s": sum(s["step_s"] for s in steps),
    }


def tpot_floor_ms(b: dict, bw: float) -> float:
    """A batch-1 decode step's floor: the non-expert weights and top-k experts per layer, at the copy rate."""
    return 1e3 * (b["dense_bytes"] + b["moe_layers"] * b["top_k"] * b["expert_bytes"]) / bw


# ---- sections ------------------------------------------------------------------------------------------
def _save(args, name: str, out: dict) -> None:
    """Partial results after every stage: a crash or time-out later keeps what finished."""
    with open(os.path.join(args.out, f"{name}.json"), "w") as f:
        json.dump(out, f, indent=2, default=str)


def _sizes(args) -> tuple[int, int, int, int, int]:
    """(prompts, input len, output len, HF prompts, HF output len), tiny under --smoke."""
    if args.smoke:
        return 6, 24, 8, min(args.hf_prompts, 6), 4
    return args.prompts, args.input_len, args.output_len, args.hf_prompts, args.hf_output_len


def _pagedllm_section(args, family: str, name: str, **llm_kw) -> tuple[dict, object, list]:
    """Start-up, batch-1 time per output token and its floor, then the throughput workload with its roofline."""
    out: dict = {"copy_bw_bytes_per_s": copy_bandwidth_bytes_per_s(), "layers_override": args.layers}
    bw = out["copy_bw_bytes_per_s"]
    n, il, ol, _, _ = _sizes(args)
    t0 = time.perf_counter()
    llm = make_llm(model_dir(family, args), args.smoke, max_model_len=max(il + ol, 256), **llm_kw)
    out["startup_s"] = time.perf_counter() - t0
    out["startup"] = startup_report(llm)
    out["startup"]["moe_workspace_gib"] = llm.llm_engine.engine_core.executor.worker.memory.moe_workspace / (1 << 30)
    b = moe_bytes(llm)
    out["bytes"] = b
    mc = llm.llm_engine.config.model_config
    out["kv_bytes_per_token"] = mc.kv_bytes_per_token()
    out["tpot_floor_ms"] = tpot_floor_ms(b, bw)
    _save(args, name, out)
    from pagedllm.entrypoints.bench.latency import measure_latency

    b1_in, b1_out = (il, 128) if not args.smoke else (il, ol)
    out["batch1"] = measure_latency(llm, 1, b1_in, b1_out, num_iters=1, num_warmup=0 if args.smoke else 1)
    out["tpot_over_floor"] = out["batch1"]["tpot_ms"] / out["tpot_floor_ms"]
    print(f"[{name}] batch 1: {out['batch1']['tpot_ms']:.3f} ms/token, floor {out['tpot_floor_ms']:.3f} ms",
          flush=True)
    _save(args, name, out)
    if not args.smoke:  # compiles kernel variants before the timed run; nothing to compile on the CPU
        warm_up(llm)
    reqs = workload_fixed(mc.vocab_size, n, il, ol)
    rec = StepRecorder(llm)
    out["workload"] = run_generate(llm, reqs, rec)
    out["workload"]["decode"] = moe_decode_roofline(rec.steps, b, out["kv_bytes_per_token"], bw, n)
    print(f"[{name}] {n} x {il}/{ol}: {out['workload']['output_tok_per_s']:.0f} out tok/s, decode roofline "
          f"{out['workload']['decode'].get('roofline_step_all')}", flush=True)
    _save(args, name, out)
    return out, llm, reqs


def section_qwen(args) -> dict:
    out, llm, reqs = _pagedllm_section(args, "qwen", "qwen")
    # The subset HF runs: the workload's first prompts, with HF's output length.
    _, _, _, hn, hol = _sizes(args)
    out["subset"] = run_generate(llm, [(p, hol) for p, _ in reqs[:hn]])
    return out


def section_hf(args) -> dict:
    """HF generate on the workload's first --hf-prompts prompts (all of them by default: the batch pagedllm
    runs), --hf-output-len new tokens each; where that batch does not fit, half of it, and so on (HF's best
    batch is the largest that fits). See the module docstring for the projection."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(model_dir("qwen", args))
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    t0 = time.perf_counter()
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.eval()
    n, il, ol, hn, hol = _sizes(args)
    all_ids = torch.tensor([p for p, _ in workload_fixed(cfg.vocab_size, n, il, ol)[:hn]], device=dev)
    model.generation_config.eos_token_id = None  # EOS ignored: every row runs the full length
    model.generation_config.pad_token_id = 0
    out = {
        "mode": f"generate(cache={'static' if args.hf_mode == 'static' else 'dynamic'}), experts "
                f"{getattr(model.config, '_experts_implementation', None)}, one batch, greedy, EOS ignored",
        "load_s": time.perf_counter() - t0,
        "input_len": il,
        "output_len": hol,
        "batches_refused": [],
    }
    kw = {"cache_implementation": "static"} if args.hf_mode == "static" else {}

    def timed(ids: torch.Tensor, new_tokens: int) -> float:  # ids [B, il]
        if dev == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.inference_mode():
            gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, **kw)
        if dev == "cuda":
            torch.cuda.synchronize()
        if gen.shape[1] - il != new_tokens:
            raise RuntimeError(f"HF generated {gen.shape[1] - il} tokens, expected {new_tokens}")
        return time.perf_counter() - start

    # A short generate on a few rows first: lazy initialisation (handles, first kernel launches) stays
    # out of the timed runs.
    out["warmup_s"] = timed(all_ids[: min(8, hn)], min(2, hol))
    _save(args, "hf", out)
    while True:
        ids = all_ids[:hn]
        try:
            out["wall_s"] = timed(ids, hol)
            out["prefill_s"] = timed(ids, 1)  # after the full run: the allocator has already grown
            break
        except torch.OutOfMemoryError:
            out["batches_refused"].append(hn)
            if hn <= 8:
                raise
            hn //= 2
            torch.cuda.empty_cache()
    out["num_prompts"] = hn
    out["useful_output_tokens"] = hn * hol
    out["useful_tok_per_s"] = hn * hol / out["wall_s"]
    out["decode_step_s"] = max(out["wall_s"] - out["prefill_s"], 0.0) / max(hol - 1, 1)
    batches = math.ceil(n / hn)
    out["projected_full_s"] = batches * (out["prefill_s"] + (ol - 1) * out["decode_step_s"])
    out["projected_full_tok_per_s"] = n * ol / out["projected_full_s"]
    # The step is measured over contexts of il..il+hol; the whole run's average context is longer, so the
    # projection is HF's best case.
    out["projection"] = (f"{batches} batch(es) of {hn} x {il}/{ol}: each its measured prefill + {ol - 1} decode "
                         f"steps at the step time measured over the first {hol} (shorter contexts: HF's best case)")
    return out


def section_mixtral(args) -> dict:
    return _pagedllm_section(args, "mixtral", "mixtral", quantization="fp8")[0]


SECTIONS = MappingProxyType({"qwen": section_qwen, "hf": section_hf, "mixtral": section_mixtral})


# ---- driver --------------------------------------------------------------------------------------------
def _fmt(x, spec=".1f"):
    return "n/a" if x is None or (isinstance(x, float) and x != x) else format(x, spec)


def summarize(res: dict) -> dict:
    q, h, m = res.get("qwen", {}), res.get("hf", {}), res.get("mixtral", {})
    s: dict = {}
    for key, r in (("qwen", q), ("mixtral", m)):
        if "batch1" in r:
            s[f"{key}_tpot_ms"] = r["batch1"]["tpot_ms"]
            s[f"{key}_tpot_floor_ms"] = r["tpot_floor_ms"]
            s[f"{key}_tpot_over_floor"] = r["tpot_over_floor"]
        if "workload" in r:
            s[f"{key}_out_tok_per_s"] = r["workload"]["output_tok_per_s"]
            s[f"{key}_roofline"] = r["workload"]["decode"].get("roofline_step_all")
    if "subset" in q and "useful_tok_per_s" in h and h["num_prompts"] == q["subset"]["num_prompts"]:
        s["subset_pagedllm_tok_per_s"] = q["subset"]["output_tok_per_s"]
        s["subset_hf_tok_per_s"] = h["useful_tok_per_s"]
        s["subset_ratio_vs_hf"] = q["subset"]["output_tok_per_s"] / h["useful_tok_per_s"]
    if "workload" in q and "projected_full_tok_per_s" in h:
        s["hf_projected_full_tok_per_s"] = h["projected_full_tok_per_s"]
        s["full_ratio_vs_hf_projected"] = q["workload"]["output_tok_per_s"] / h["projected_full_tok_per_s"]
    return s


def print_table(res: dict, s: dict, args) -> None:
    q, h, m = res.get("qwen", {}), res.get("hf", {}), res.get("mixtral", {})
    bw = q.get("copy_bw_bytes_per_s") or m.get("copy_bw_bytes_per_s")
    print(f"\ncopy bandwidth (read+write): {_fmt(bw and bw / 1e12, '.2f')} TB/s")
    if args.layers:
        print(f"LAYERS OVERRIDDEN: both models cut to {args.layers} layers (not the real shapes)")
    for name in ("qwen", "hf", "mixtral"):
        for key in ("error", "timeout"):
            if key in res.get(name, {}):
                print(f"[{name}] {key.upper()}: {res[name][key][-600:]}")
    n, il, ol, hn, hol = _sizes(args)
    if h:
        print(f"HF: {h.get('mode')}; {h.get('num_prompts')} of the {n} prompts, {hol} new tokens each (time "
              f"budget; batches refused for memory: {h.get('batches_refused')}); projected: {h.get('projection')}")
    rows = [
        (f"Qwen3-30B-A3B bf16 {n} x {il}/{ol} out tok/s", _fmt(s.get("qwen_out_tok_per_s")), ""),
        (f"  same run {hn} x {il}/{hol}: pagedllm / HF out tok/s",
         f"{_fmt(s.get('subset_pagedllm_tok_per_s'))} / {_fmt(s.get('subset_hf_tok_per_s'))}", ""),
        ("  ratio vs HF: same run / whole (HF projected)",
         f"{_fmt(s.get('subset_ratio_vs_hf'))}x / {_fmt(s.get('full_ratio_vs_hf_projected'))}x", ">= 20x"),
        ("  decode roofline fraction (experts touched + KV)", _fmt(s.get("qwen_roofline"), ".2f"), ">= 0.60"),
        ("  batch-1 ms/token (floor) -> over floor",
         f"{_fmt(s.get('qwen_tpot_ms'), '.3f')} ({_fmt(s.get('qwen_tpot_floor_ms'), '.3f')}) -> "
         f"{_fmt(s.get('qwen_tpot_over_floor'), '.2f')}x", "<= 1.6x"),
        (f"Mixtral-8x7B fp8 experts {n} x {il}/{ol} out tok/s", _fmt(s.get("mixtral_out_tok_per_s")), ""),
        ("  decode roofline fraction (experts touched + KV)", _fmt(s.get("mixtral_roofline"), ".2f"), ""),
        ("  batch-1 ms/token (floor) -> over floor",
         f"{_fmt(s.get('mixtral_tpot_ms'), '.3f')} ({_fmt(s.get('mixtral_tpot_floor_ms'), '.3f')}) -> "
         f"{_fmt(s.get('mixtral_tpot_over_floor'), '.2f')}x", ""),
    ]
    print(f"{'workload':52s} {'measured':>30s} {'target':>8s}")
    for name, val, target in rows:
        print(f"{name:52s} {val:>30s} {target:>8s}")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--sections", default="qwen,hf,mixtral", help="comma-separated, of: " + ",".join(SECTIONS))
    ap.add_argument("--prompts", type=_positive, default=256)
    ap.add_argument("--input-len", type=_positive, default=1000)
    ap.add_argument("--output-len", type=_positive, default=1000)
    ap.add_argument("--hf-prompts", type=_positive, default=256,
                    help="HF's batch: the workload's first prompts (halved while it does not fit)")
    ap.add_argument("--hf-output-len", type=_positive, default=32, help="new tokens each in HF's run")
    ap.add_argument("--hf-mode", choices=("dynamic", "static"), default="dynamic")
    ap.add_argument("--layers", type=_positive, default=None, help="cut both models to this many layers")
    ap.add_argument("--budget-s", type=float, default=290.0, help="wall budget of all sections together")
    ap.add_argument("--smoke", action="store_true", help="tiny configs on the CPU: checks the script itself")
    ap.add_argument("--section", default=None, help=argparse.SUPPRESS)  # internal: run one section here
    args = ap.parse_args(argv)
    unknown = [s for s in args.sections.split(",") if s and s not in SECTIONS]
    if unknown:
        ap.error(f"--sections: unknown {unknown}; known: {', '.join(SECTIONS)}")
    if args.hf_prompts > args.prompts:
        ap.error(f"--hf-prompts {args.hf_prompts} exceeds --prompts {args.prompts}")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.section:
        res = SECTIONS[args.section](args)
        _save(args, args.section, res)
        return res

    t_start = time.time()
    results: dict = {}
    passthrough = list(argv if argv is not None else sys.argv[1:])
    for name in [s for s in args.sections.split(",") if s]:
        left = args.budget_s - (time.time() - t_start)
        cmd = [sys.executable, os.path.abspath(__file__), *passthrough, "--section", name, "--out", args.out]
        print(f"== section {name} (budget left {left:.0f} s)", flush=True)
        partial = os.path.join(args.out, f"{name}.json")
        if os.path.exists(partial):
            os.remove(partial)  # a previous run's file must not pass for this one's
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        t0 = time.time()
        try:
            proc = subprocess.run(cmd, env=env, timeout=max(left, 20), capture_output=True, text=True)
            log = proc.stdout + proc.stderr
            results[name] = json.load(open(partial)) if os.path.exists(partial) else {}
            if proc.returncode != 0:
                results[name]["error"] = log[-3000:]
        except subprocess.TimeoutExpired as e:
            log = "".join(x.decode(errors="replace") if isinstance(x, bytes) else (x or "") for x in (e.stdout, e.stderr))
            results[name] = json.load(open(partial)) if os.path.exists(partial) else {}
            results[name]["timeout"] = f"timed out after {e.timeout:.0f} s"
        results[name]["section_wall_s"] = time.time() - t0
        with open(os.path.join(args.out, f"{name}.log"), "w") as f:
            f.write(log)
        print(f"   {name}: {results[name]['section_wall_s']:.0f} s", flush=True)
    summary = summarize(results)
    settings = {k: getattr(args, k) for k in ("prompts", "input_len", "output_len", "hf_prompts", "hf_output_len",
                                              "hf_mode", "layers", "smoke")}
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump({"settings": settings, "summary": summary, "results": results}, f, indent=2, default=str)
    print_table(results, summary, args)
    return {"summary": summary, "results": results}


if __name__ == "__main__":
    main()
