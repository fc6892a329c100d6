"""GPU measurement helpers for the H200 benchmarks: copy bandwidth, per-step recording, roofline, profiles."""
from __future__ import annotations

import random
import statistics
import time


# ---- workloads ---------------------------------------------------------------------------------------
def workload_qwen(vocab: int, n: int = 256, lo: int = 100, hi: int = 1024, seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt ids, output length) pairs: lengths uniform in [lo, hi], ids uniform above the special tokens."""
    rng = random.Random(seed)
    lens = [(rng.randint(lo, hi), rng.randint(lo, hi)) for _ in range(n)]
    return [([rng.randrange(min(1000, vocab // 4), vocab) for _ in range(i)], o) for i, o in lens]


def workload_fixed(vocab: int, n: int, input_len: int, output_len: int, seed: int = 1) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(min(1000, vocab // 4), vocab) for _ in range(input_len)], output_len) for _ in range(n)]


def median_event_ms(fn, reps: int = 20) -> float:
    """Median device time of ``fn()`` in ms, CUDA events around each call, after one untimed call."""
    import torch

    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth_bytes_per_s(nbytes: int = 4 << 30) -> float:
    """Device-to-device copy rate counting bytes read plus written (the DEVICE.md convention)."""
    import torch

    if not torch.cuda.is_available():
        return float("nan")
    src = torch.randn(nbytes // 4, device="cuda")  # random data, never zeros
    dst = torch.empty_like(src)
    dst.copy_(src)
    seconds = median_event_ms(lambda: dst.copy_(src), reps=10) / 1e3
    src = dst = None  # frees both; the lambda above still names them, so they are rebound, not deleted
    torch.cuda.empty_cache()
    return 2 * nbytes / seconds


class StepRecorder:
    """Wraps the engine's step (and the executor's execute_model) of one LLM to time every step.

    Synchronous scheduling: each step is timed to its end on the device, with the runner's share.
    Asynchronous scheduling: a step call returns the output of the step submitted by the call before,
    so a step's time is the interval between two returns (the device's pace when it is the bottleneck),
    and there is no separate runner share: ``runner_s`` repeats ``step_s``. There, with
    ``device_times``, each step's device time (two CUDA events) is kept as ``device_s`` too: a step
    interval well above it means the host set the pace.
    """

    def __init__(self, llm, device_times: bool = False) -> None:
        self.llm = llm
        core = llm.llm_engine.engine_core
        self.runner = core.executor.worker.model_runner
        self.async_mode = core.async_scheduling
        self.device_times = device_times and self.async_mode and self.runner.device.type == "cuda"
        self.steps: list[dict] = []
        self.enabled = False
        self._last_return: float | None = None
        self._device_s: float | None = None
        exec_fn, step_fn, take_fn = core.executor.execute_model, llm.llm_engine.step, core.executor.take_output
        sync = _cuda_sync()

        def timed_take():
            out = take_fn()
            self._device_s = out.device_time_s
            return out

        def timed_execute(so):
            t0 = time.perf_counter()
            out = exec_fn(so)
            self._exec = time.perf_counter() - t0
            return out

        def record(info, runner_s: float, step_s: float) -> None:
            if self.enabled and info is not None:
                self.steps.append(
                    dict(reqs=info.num_reqs, tokens=info.num_tokens, ctx=info.context_tokens,
                         graph=info.graph_size, graph_tokens=info.graph_tokens, runner_s=runner_s, step_s=step_s,
                         device_s=self._device_s)
                )

        def timed_step():
            if self.async_mode:
                info = self.runner.last_step  # submitted by the previous call; this one returns its output
                self._device_s = None
                out = step_fn()
                now = time.perf_counter()
                if self._last_return is not None:
                    record(info, now - self._last_return, now - self._last_return)
                self._last_return = now
                return out
            self._exec = 0.0
            self.runner.last_step = None
            t0 = time.perf_counter()
            out = step_fn()
            sync()
            record(self.runner.last_step, self._exec, time.perf_counter() - t0)
            return out

        core.executor.execute_model = timed_execute
        core.executor.take_output = timed_take
        llm.llm_engine.step = timed_step

    def start(self) -> None:
        self.steps.clear()
        self._last_return = None
        self.enabled = True
        if self.device_times:
            self.runner.time_steps = True

    def stop(self) -> None:
        self.enabled = False
        if self.device_times:
            self.runner.time_steps = self.runner.config.scheduler_config.submit_just_in_time


def _cuda_sync():
    import torch

    return torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)


def weight_bytes_read(llm) -> int:
    """Bytes of parameters a decode step reads: all of them but an untied input embedding (row gathers)."""
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    model = runner.model
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    emb = model.model.embed_tokens.weight
    if not getattr(model, "tie_word_embeddings", False):
        total -= emb.numel() * emb.element_size()
    return total


def decode_roofline(steps: list[dict], weight_bytes: int, kv_bytes_per_token: int, bw: float, full_batch: int) -> dict:
    """Roofline fraction of pure-decode steps, over their runner time (forward + sampling) and whole step time."""
    dec = [s for s in steps if s["tokens"] == s["reqs"]]
    if not dec:
        return {}

    def frac(sel, key):
        if not sel:
            return None
        moved = sum(weight_bytes + s["ctx"] * kv_bytes_per_token for s in sel)
        return moved / sum(s[key] for s in sel) / bw

    full = [s for s in dec if s["reqs"] == full_batch]
    return {
        "decode_steps": len(dec),
        "full_batch_steps": len(full),
        "roofline_runner_all": frac(dec, "runner_s"),
        "roofline_step_all": frac(dec, "step_s"),
        "roofline_runner_full_batch": frac(full, "runner_s"),
        "roofline_step_full_batch": frac(full, "step_s"),
        "median_runner_ms_full_batch": 1e3 * statistics.median([s["runner_s"] for s in full]) if full else None,
        "median_step_ms_full_batch": 1e3 * statistics.median([s["step_s"] for s in full]) if full else None,
        "median_ctx_full_batch": statistics.median([s["ctx"] for s in full]) if full else None,
        "decode_time_s": sum(s["step_s"] for s in dec),
        "decode_runner_time_s": sum(s["runner_s"] for s in dec),
        "all_steps": len(steps),
        "all_step_time_s": sum(s["step_s"] for s in steps),
    }


def decode_profile(steps: list[dict], kv_bytes_per_token: int, bw: float) -> dict:
    """Pure-decode steps by batch size: count, time, the share the device was busy, and a fit of device
    time = fixed + KV bytes / rate, which splits a step into its per-step cost and its KV streaming."""
    import numpy as np

    dec = [s for s in steps if s["tokens"] == s["reqs"] and s.get("device_s")]
    if len(dec) < 3:
        return {}
    out: dict = {"buckets": []}
    for lo, hi in ((1, 16), (17, 64), (65, 128), (129, 192), (193, 256), (257, 1 << 20)):
        sel = [s for s in dec if lo <= s["reqs"] <= hi]
        if not sel:
            continue
        dev = sum(s["device_s"] for s in sel)
        kv = sum(s["ctx"] for s in sel) * kv_bytes_per_token
        out["buckets"].append({
            "reqs": f"{lo}-{hi}", "steps": len(sel), "step_s": sum(s["step_s"] for s in sel), "device_s": dev,
            "mean_device_ms": 1e3 * dev / len(sel), "kv_frac_of_copy": kv / dev / bw,
        })
    x = np.array([s["ctx"] * kv_bytes_per_token for s in dec], dtype=np.float64)
    y = np.array([s["device_s"] for s in dec])
    a = np.vstack([np.ones_like(x), x]).T
    (fixed, per_byte), *_ = np.linalg.lstsq(a, y, rcond=None)
    out["fit_fixed_ms"] = 1e3 * fixed
    out["fit_kv_rate_frac_of_copy"] = 1.0 / per_byte / bw if per_byte > 0 else None
    out["decode_step_s"] = sum(s["step_s"] for s in dec)
    out["decode_device_s"] = sum(s["device_s"] for s in dec)
    return out


def print_decode_profile(p: dict) -> None:
    if not p:
        return
    print(f"  decode steps: {p['decode_step_s']:.2f} s wall, {p['decode_device_s']:.2f} s on the device; fit: "
          f"{p['fit_fixed_ms']:.3f} ms a step + KV at {p['fit_kv_rate_frac_of_copy']:.0%} of the copy rate")
    for b in p["buckets"]:
        print(f"    batch {b['reqs']:>9s}: {b['steps']:5d} steps  {b['step_s']:6.2f} s wall  {b['device_s']:6.2f} s device"
              f"  {b['mean_device_ms']:6.2f} ms/step  KV {b['kv_frac_of_copy']:5.0%} of copy")


def run_generate(llm, reqs: list[tuple[list[int], int]], recorder: StepRecorder | None = None) -> dict:
    from pagedllm import SamplingParams

    llm.llm_engine.engine_core.reset_prefix_cache()
    prompts = [{"prompt_token_ids": p} for p, _ in reqs]
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=o, detokenize=False) for _, o in reqs]
    if recorder is not None:
        recorder.start()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    if recorder is not None:
        recorder.stop()
    num_out = sum(len(o.outputs[0].token_ids) for o in outs)
    want = sum(o for _, o in reqs)
    if num_out != want:
        raise RuntimeError(f"generated {num_out} tokens, requested {want}")
    return {
        "num_prompts": len(reqs),
        "input_tokens": sum(len(p) for p, _ in reqs),
        "output_tokens": num_out,
        "elapsed_s": elapsed,
        "output_tok_per_s": num_out / elapsed,
    }


def warm_up(llm) -> None:
    """Triton specialises integer arguments (== 1, multiple of 16, other): batches whose request and token
    counts take each kind compile the prefill/mixed kernels' variants here instead of inside a timed run."""
    vocab = llm.llm_engine.config.model_config.vocab_size
    for n, in_len in ((16, 64), (17, 64), (16, 65), (17, 65)):
        run_generate(llm, workload_fixed(vocab, n, in_len, 4, seed=7 + n + in_len))


def make_llm(model: str, smoke: bool, **kw):
    from pagedllm import LLM

    args = dict(model=model, load_format="dummy", skip_tokenizer_init=True, seed=0, max_model_len=2048, max_num_seqs=256)
    if smoke:
        args.update(device="cpu", dtype="float32", max_model_len=256, max_num_seqs=8)
    else:
        args.update(dtype="bfloat16")
    args.update(kw)
    return LLM(**args)


def startup_report(llm) -> dict:
    worker = llm.llm_engine.engine_core.executor.worker
    mem = worker.memory
    g = 1 << 30
    cfg = llm.llm_engine.config
    blocks = llm.llm_engine.engine_core.num_blocks
    return {
        "phases_s": dict(worker.startup.phases),
        "memory_gib": {k: getattr(mem, k) / g for k in ("total", "usable", "weights", "activations", "sampler",
                                                        "graph_pool", "non_torch", "kv_cache")},
        "kv_blocks": blocks,
        "max_len_sequences_fit": blocks * cfg.cache_config.block_size / cfg.model_config.max_model_len,
        "graph_sizes": list(worker.model_runner.graph_runner.sizes) if worker.model_runner.graph_runner else [],
        "mixed_graph_tokens": (list(worker.model_runner.mixed_graph_runner.sizes)
                               if worker.model_runner.mixed_graph_runner else []),
    }


def classify_kernel(name: str) -> str:
    name = name.lower()
    if "paged_attention" in name or "reduce_splits" in name:
        return "attention"
    if "reshape_and_cache" in name:
        return "kv_write"
    if "gemv_kernel" in name or any(s in name for s in ("gemm", "gemv", "cutlass", "nvjet", "sm90", "xmma", "cublas", "splitk")):
        return "matmul"
    if "rms_norm" in name or "rmsnorm" in name:
        return "norm"
    if "rotary" in name:
        return "rotary"
    if "act_and_mul" in name:
        return "act_mul"
    if "memcpy" in name or "memset" in name:
        return "copy"
    return "elementwise/other"


def _profile_table(prof, per: int) -> dict:
    """Device time and kernel count per class, divided by ``per`` (steps), plus the top kernels."""
    classes: dict[str, list[float]] = {}
    for evt in prof.key_averages():
        dev_us = getattr(evt, "self_device_time_total", None) or getattr(evt, "self_cuda_time_total", 0)
        if dev_us <= 0:
            continue
        c = classes.setdefault(classify_kernel(evt.key), [0.0, 0])
        c[0] += dev_us
        c[1] += evt.count
    return {
        "per_step_device_us": {k: v[0] / per for k, v in classes.items()},
        "per_step_kernels": {k: v[1] / per for k, v in classes.items()},
        "top": [(e.key[:60], getattr(e, "self_device_time_total", 0) / per, e.count / per)
                for e in sorted(prof.key_averages(), key=lambda e: -getattr(e, "self_device_time_total", 0))[:15]],
    }


def kernel_profile(llm, batch: int, input_len: int, steps: int, eager: bool) -> dict:
    """Device time per kernel class over a few decode steps (torch.profiler)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from pagedllm import SamplingParams

    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    vocab = llm.llm_engine.config.model_config.vocab_size
    reqs = workload_fixed(vocab, batch, input_len, steps + 1, seed=99)
    prompts = [{"prompt_token_ids": p} for p, _ in reqs]
    saved = runner.use_cuda_graphs
    runner.use_cuda_graphs = not eager
    try:
        # The first run fills the prefix cache, so the profiled run's prefill computes only each
        # prompt's last partial block and the decode steps dominate the profile.
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=steps + 1, detokenize=False)
        llm.generate(prompts, params, use_tqdm=False)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
    finally:
        runner.use_cuda_graphs = saved
    return {"eager": eager, "batch": batch, **_profile_table(prof, steps + 1)}


def prefill_profile(llm, input_len: int, reps: int = 3, num_prompts: int = 1) -> dict:
    """Device time per kernel class of the prefill of ``num_prompts`` prompts in one step (one token
    sampled each), averaged over ``reps``."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from pagedllm import SamplingParams

    vocab = llm.llm_engine.config.model_config.vocab_size
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=1, detokenize=False)
    prompts = [{"prompt_token_ids": p} for p, _ in workload_fixed(vocab, reps * num_prompts, input_len, 1, seed=98)]
    batches = [prompts[i : i + num_prompts] for i in range(0, len(prompts), num_prompts)]
    llm.generate(batches[0], params, use_tqdm=False)
    llm.llm_engine.engine_core.reset_prefix_cache()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for batch in batches:
            llm.generate(batch, params, use_tqdm=False)
        torch.cuda.synchronize()
    out = {"input_len": input_len, "num_prompts": num_prompts, **_profile_table(prof, reps)}
    if num_prompts == 1:
        out.update(prefill_host_time(llm, prompts, params))
    return out


def launch_overhead_us(calls: int = 2000) -> dict[str, float]:
    """Host microseconds per eager call on tiny CUDA tensors: a torch op, cuBLAS, and two Triton kernels.

    The device work is negligible, so this is what each launch costs the host; an eager forward pays it
    for every kernel it launches.
    """
    import time

    import torch

    from pagedllm.kernels.activation import act_and_mul
    from pagedllm.kernels.rmsnorm import rms_norm

    x = torch.randn(16, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    nw = torch.ones(1024, device="cuda", dtype=torch.bfloat16)
    cases = {
        "torch add": lambda: torch.add(x, x),
        "cuBLAS linear": lambda: torch.nn.functional.linear(x, w),
        "Triton rms_norm": lambda: rms_norm(x, nw, 1e-6),
        "Triton rms_norm + residual": lambda: rms_norm(x, nw, 1e-6, residual=x),
        "Triton act_and_mul": lambda: act_and_mul(x, "silu"),
    }
    out = {}
    for name, fn in cases.items():
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out[name] = (time.perf_counter() - t0) / calls * 1e6
        torch.cuda.synchronize()
    return out


def prefill_host_time(llm, prompts: list, params) -> dict:
    """Host time to launch one prefill forward (graph replay or eager launches) and wall time per prompt.

    When the enqueue time nears the step's device time, the prefill is host-bound: faster launches,
    not faster kernels, would shorten it.
    """
    import time

    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    forward, enqueue = runner._forward, []

    def timed_forward(*a, **kw):
        # The step's forward pass as launched: a graph replay (with its input upload) or eager launches.
        t0 = time.perf_counter()
        out = forward(*a, **kw)
        enqueue.append(time.perf_counter() - t0)
        return out

    walls = []
    runner._forward = timed_forward
    try:
        for p in prompts:
            llm.llm_engine.engine_core.reset_prefix_cache()
            t0 = time.perf_counter()
            llm.generate([p], params, use_tqdm=False)
            walls.append(time.perf_counter() - t0)
    finally:
        del runner._forward
    return {"host_forward_ms": [e * 1e3 for e in enqueue], "wall_ms": [w * 1e3 for w in walls]}
