"""Calibrated weight quantization of a transformers decoder (Gemma 3, Llama) for the accuracy checkpoints: GPTQ
(Hessian-guided rounding, Frantar et al. 2022), AWQ (activation-aware scales and clipping, Lin et al. 2023) and
SmoothQuant (activation outliers moved into the weights, Xiao et al. 2022), written from the papers.

llm-compressor's implementations are the field's, but its releases pin compressed-tensors and transformers below
the versions the test suite needs, so they cannot be installed beside them; these follow the same algorithms.

Every method works layer by layer on a calibration text: a decoder layer's linear inputs are recorded while the
layer runs on the outputs of the layers already quantized, its weights are changed in place (quantize-dequantize
for GPTQ/AWQ, so the model itself is the float reference of its checkpoint), and its outputs feed the next layer.
Each returns the integer grids of every quantized linear so that the checkpoint writers pack exactly those numbers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# (input norm or previous linear, the linears that read its output) of a decoder layer, for AWQ and SmoothQuant.
# Gemma's norms multiply by (1 + weight); v_proj -> o_proj is left out as its shapes differ under grouped queries.
_SCALE_GROUPS = (("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                 ("pre_feedforward_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
                 ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),  # Llama's name for the MLP's norm
                 ("mlp.up_proj", ("mlp.down_proj",)))
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")


@dataclass
class Grid:
    """A linear's 4-bit group grid: q [N, K] ints in [0, 15], zeros [N, K/g] ints, scales [N, K/g] float16;
    ``g_idx`` [K]: each input column's group where GPTQ's act-order grouped the columns out of order, else None."""
    q: torch.Tensor
    zeros: torch.Tensor
    scales: torch.Tensor
    g_idx: torch.Tensor | None = None

    def rows(self, rows: slice) -> "Grid":
        return Grid(self.q[rows], self.zeros[rows], self.scales[rows], self.g_idx)


def group_grid(w: torch.Tensor, group: int, sym: bool, clip: torch.Tensor | None = None):
    """The 4-bit grid of each (row, group) of ``w`` [N, K]: (scales [N, G] float16, zeros [N, G]). Symmetric:
    zero 8 and a step of 2 max|w| / 15 (GPTQ's); asymmetric: 15 steps over [min, max] (AWQ's). ``clip`` [N, G]
    shrinks the range."""
    n, k = w.shape
    wg = w.reshape(n, k // group, group)
    lo, hi = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
    if clip is not None:
        lo, hi = lo * clip, hi * clip
    if sym:
        hi = torch.maximum(-lo, hi)
        scales = (2 * hi / 15).clamp(min=1e-8).half()
        zeros = torch.full_like(hi, 8.0)
    else:
        scales = ((hi - lo) / 15).clamp(min=1e-8).half()
        zeros = torch.clamp(torch.round(-lo / scales.float()), 0, 15)
    return scales, zeros


def quantize_cols(w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor):
    """Integers [N, C] and their dequantized values of columns ``w`` [N, C] on one grid (scales, zeros [N])."""
    s = scales.float()[:, None]
    q = torch.clamp(torch.round(w / s) + zeros[:, None], 0, 15)
    return q, (q - zeros[:, None]) * s


def rtn(w: torch.Tensor, group: int, sym: bool, clip: torch.Tensor | None = None) -> tuple[Grid, torch.Tensor]:
    """Round to nearest on each group's grid: (grid, dequantized weight [N, K])."""
    scales, zeros = group_grid(w, group, sym, clip)
    zk = zeros.repeat_interleave(group, dim=1)
    sk = scales.repeat_interleave(group, dim=1)
    q = torch.clamp(torch.round(w / sk.float()) + zk, 0, 15)
    return Grid(q.to(torch.int32), zeros.to(torch.int32), scales), (q - zk) * sk.float()


def gptq(w: torch.Tensor, hessian: torch.Tensor, group: int, sym: bool, damp: float = 0.01,
         act_order: bool = False) -> tuple[Grid, torch.Tensor]:
    """GPTQ of ``w`` [N, K] with ``hessian`` [K, K] = sum of x x^T over the calibration tokens: columns are rounded
    in order, each one's rounding error spread over the columns not yet rounded through the inverse Hessian's
    Cholesky factor; a group's grid is taken from its columns as they stand when the group is reached.
    ``damp``: the fraction of the Hessian's mean diagonal added to it; ``act_order``: columns taken (and grouped)
    in order of decreasing Hessian diagonal, so the most active inputs are rounded while most columns can still
    absorb their error (the grid's ``g_idx`` then says each column's group)."""
    w = w.clone().float()
    n, k = w.shape
    h = hessian.clone().double()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    perm = torch.argsort(torch.diag(h), descending=True, stable=True) if act_order else torch.arange(k)
    w, h = w[:, perm], h[perm][:, perm]
    h += damp * torch.diag(h).mean() * torch.eye(k, dtype=h.dtype)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).float()  # [K, K]
    q_all = torch.zeros(n, k)
    deq_all = torch.zeros(n, k)
    scales_all, zeros_all = [], []
    for g0 in range(0, k, group):  # one block per group: the grid comes from the block's updated columns
        g1 = g0 + group
        block = w[:, g0:g1].clone()
        scales, zeros = group_grid(block, group, sym)
        scales, zeros = scales[:, 0], zeros[:, 0]
        scales_all.append(scales)
        zeros_all.append(zeros)
        errs = torch.zeros_like(block)
        hb = hinv[g0:g1, g0:g1]
        for i in range(group):
            col = block[:, i]
            q, deq = quantize_cols(col[:, None], scales, zeros)
            q_all[:, g0 + i], deq_all[:, g0 + i] = q[:, 0], deq[:, 0]
            err = (col - deq[:, 0]) / hb[i, i]
            block[:, i:] -= err[:, None] * hb[i, i:][None, :]
            errs[:, i] = err
        w[:, g1:] -= errs @ hinv[g0:g1, g1:]
    inv = torch.argsort(perm)
    g_idx = None
    if act_order:
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[perm] = (torch.arange(k) // group).to(torch.int32)
    grid = Grid(q_all[:, inv].to(torch.int32), torch.stack(zeros_all, 1).to(torch.int32),
                torch.stack(scales_all, 1), g_idx)
    return grid, deq_all[:, inv]


# ---- running a model layer by layer ---------------------------------------------------------------------------


def _layer_inputs(model, batches: list[torch.Tensor]) -> list[tuple[torch.Tensor, list[dict]]]:
    """For each batch of token ids [B, T]: (the hidden states entering the first decoder layer [B, T, H], each
    layer's keyword arguments: masks, positions). Only the embeddings run: the layers pass their input through
    while they are recorded, and the LM head is not reached."""
    layers = model.model.layers
    out = []
    for ids in batches:
        captured: dict = {"kwargs": []}

        def hook(module, args, kwargs):
            if not captured["kwargs"]:
                captured["h"] = args[0] if args else kwargs["hidden_states"]
            captured["kwargs"].append({k: v for k, v in kwargs.items()
                                       if k not in ("hidden_states", "cache", "past_key_values")})

        handles = [layer.register_forward_pre_hook(hook, with_kwargs=True) for layer in layers]
        for layer in layers:
            layer.forward = _passthrough
        try:
            with torch.no_grad():
                model.model(ids, use_cache=False)
        finally:
            for layer in layers:
                del layer.forward
            for h in handles:
                h.remove()
        out.append((captured["h"], captured["kwargs"]))
    return out


def _passthrough(*args, **kwargs):
    return args[0] if args else kwargs["hidden_states"]


def _run_layer(layer, h: torch.Tensor, kwargs: dict) -> torch.Tensor:
    out = layer(h, **kwargs)
    return out[0] if isinstance(out, tuple) else out


def _record_inputs(layer, batches, li: int, names) -> dict[str, torch.Tensor]:
    """The inputs [T, K] each named linear of ``layer`` (decoder layer ``li``) sees when it runs on each batch's
    hidden states, all batches' tokens together."""
    seen: dict[str, list[torch.Tensor]] = {name: [] for name in names}
    handles = []
    for name in names:
        mod = layer.get_submodule(name)
        handles.append(mod.register_forward_hook(lambda m, a, o, name=name: seen[name].append(
            a[0].reshape(-1, a[0].shape[-1]).detach().float())))
    try:
        with torch.no_grad():
            for h, kwargs in batches:
                _run_layer(layer, h, kwargs[li])
    finally:
        for hd in handles:
            hd.remove()
    return {name: torch.cat(xs, 0) for name, xs in seen.items()}


def _batches(ids, batch: int) -> list[torch.Tensor]:
    """Token ids [B, T] of one sequence (a list of ints) or of sequences (lists of ints), ``batch`` sequences of
    one length at a time."""
    seqs = [ids] if ids and isinstance(ids[0], int) else list(ids)
    out: list[list[list[int]]] = []
    for seq in seqs:
        if out and len(out[-1]) < batch and len(out[-1][0]) == len(seq):
            out[-1].append(seq)
        else:
            out.append([seq])
    return [torch.tensor(b) for b in out]


def _same_input(names: list[str]) -> list[list[str]]:
    """``names`` grouped by the input they read (q/k/v, gate/up), in order."""
    groups: dict[str, list[str]] = {}
    for name in names:
        key = name.rsplit(".", 1)[0] if name.endswith(("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")) else name
        groups.setdefault(key, []).append(name)
    return list(groups.values())


def _linears(layer) -> list[str]:
    return [n for n in LINEARS if _has(layer, n)]


def _has(layer, name: str) -> bool:
    try:
        layer.get_submodule(name)
        return True
    except AttributeError:
        return False


def _scale_groups(layer):
    return [(prev, linears) for prev, linears in _SCALE_GROUPS
            if _has(layer, prev) and all(_has(layer, n) for n in linears)
            and not (prev == "post_attention_layernorm" and _has(layer, "pre_feedforward_layernorm"))]


def _fold_scale(layer, prev: str, linears, s: torch.Tensor) -> None:
    """Divides ``prev``'s output channels by ``s`` [K] and multiplies the linears' input columns by it: the layer
    computes the same function, with the linears' inputs scaled down where ``s`` is large."""
    p = layer.get_submodule(prev)
    if isinstance(p, torch.nn.Linear):
        p.weight.data.div_(s[:, None])
        if p.bias is not None:
            p.bias.data.div_(s)
    elif type(p).__name__.startswith("Gemma"):  # output * (1 + weight)
        p.weight.data.copy_((1 + p.weight.data.float()) / s - 1)
    else:
        p.weight.data.div_(s)
    for name in linears:
        layer.get_submodule(name).weight.data.mul_(s[None, :])


def quantize_model(model, ids, method: str, group: int = 128, sym: bool = True,
                   smooth_alpha: float | str = 0.8, act_symmetric: bool = True, *, batch: int = 8,
                   act_order: bool = False, damp: float = 0.01, search_tokens: int = 4096) -> dict[str, Grid]:
    """Quantizes ``model``'s decoder linears in place by ``method`` ('gptq', 'awq', 'rtn' or 'smooth')
    calibrated on ``ids`` (one sequence of token ids, or sequences run ``batch`` at a time); returns {module name:
    Grid} of the 4-bit methods ('smooth' only moves the scales; its int8 rounding is left to the checkpoint maker).
    ``smooth_alpha`` 'auto': SmoothQuant's migration strength chosen per layer and linear group from
    ``ALPHA_GRID``, the one whose W8A8 products (activations per token, ``act_symmetric`` or with a zero point)
    come closest to the float ones on the calibration inputs. GPTQ: ``damp``, ``act_order`` as ``gptq``. AWQ's
    searches score at most
    ``search_tokens`` calibration tokens (evenly spaced) for time; its statistics use them all."""
    batches = _layer_inputs(model, _batches(ids, batch))
    grids: dict[str, Grid] = {}
    scaled = method in ("awq", "smooth")
    for li, layer in enumerate(model.model.layers):
        names = _linears(layer)
        if scaled:
            xs = _record_inputs(layer, batches, li, names)
            for prev, linears in _scale_groups(layer):
                x = xs[linears[0]]
                ws = [layer.get_submodule(n).weight.data.float() for n in linears]
                if method == "smooth":
                    alpha = smooth_alpha
                    if alpha == "auto":
                        alpha = min(ALPHA_GRID, key=lambda a: _w8a8_error(x, ws, _smooth_scale(x, ws, a),
                                                                          act_symmetric))
                    s = _smooth_scale(x, ws, alpha)
                else:
                    s = _awq_scale(x, ws, group, sample=search_tokens)
                _fold_scale(layer, prev, linears, s)
            if method == "smooth" and _has(layer, "self_attn.v_proj") and _has(layer, "self_attn.o_proj"):
                x, attn = xs["self_attn.o_proj"], layer.self_attn
                alpha = smooth_alpha
                if alpha == "auto":
                    o = [attn.o_proj.weight.data.float()]
                    alpha = min(ALPHA_GRID, key=lambda a: _w8a8_error(x, o, _v_o_scale(attn, x, a)[1], act_symmetric))
                _smooth_v_into_o(layer, x, alpha)
            del xs
        if method == "awq":  # clipping after scaling, on the scaled inputs
            xs = _record_inputs(layer, batches, li, names)
            for name in names:
                mod = layer.get_submodule(name)
                w = mod.weight.data.float()
                # As AutoAWQ: the query and key projections keep their full range (attention scores are sensitive).
                clip = None if name.endswith(("q_proj", "k_proj")) else _awq_clip(w, xs[name], group)
                grid, deq = rtn(w, group, False, clip)
                mod.weight.data.copy_(deq)
                grids[f"model.layers.{li}.{name}"] = grid
        elif method == "gptq":
            xs = _record_inputs(layer, batches, li, names)
            for same in _same_input(names):  # rows are rounded independently: linears sharing an input go together
                x = xs[same[0]]
                mods = [layer.get_submodule(n) for n in same]
                grid, deq = gptq(torch.cat([m.weight.data.float() for m in mods], 0), x.t() @ x, group, sym, damp,
                                 act_order)
                row = 0
                for name, mod in zip(same, mods):
                    rows = slice(row, row + mod.weight.shape[0])
                    mod.weight.data.copy_(deq[rows])
                    grids[f"model.layers.{li}.{name}"] = grid.rows(rows)
                    row = rows.stop
            del xs
        elif method == "rtn":
            for name in names:
                mod = layer.get_submodule(name)
                grid, deq = rtn(mod.weight.data.float(), group, sym)
                mod.weight.data.copy_(deq)
                grids[f"model.layers.{li}.{name}"] = grid
        with torch.no_grad():
            batches = [(_run_layer(layer, h, kwargs[li]), kwargs) for h, kwargs in batches]
    return grids


def _smooth_scale(x: torch.Tensor, ws, alpha: float) -> torch.Tensor:
    """SmoothQuant's per-channel scale max|x|^a / max|w|^(1-a) [K]."""
    amax = x.abs().amax(0).clamp(min=1e-5)
    wmax = torch.cat(ws, 0).abs().amax(0).clamp(min=1e-5)
    return (amax.pow(alpha) / wmax.pow(1 - alpha)).clamp(min=1e-5)


# SmoothQuant's migration strengths tried where they are chosen per layer (``smooth_alpha='auto'``).
ALPHA_GRID = tuple(i / 20 for i in range(21))


def _w8a8_error(x: torch.Tensor, ws, s: torch.Tensor, act_symmetric: bool) -> float:
    """Squared error against the float products ``x @ w.T`` of the W8A8 products after smoothing by ``s`` [K]:
    inputs ``x / s`` int8 per token, weights ``w * s`` int8 per output row (pagedllm's arithmetic)."""
    from pagedllm.kernels.int8_quant import quantize_int8_rows

    xq, xs, xz = quantize_int8_rows(x / s, act_symmetric)
    xd = (xq.float() - (0 if xz is None else xz)) * xs
    err = 0.0
    for w in ws:
        wq, w_scale, _ = quantize_int8_rows(w * s)
        err += (xd @ (wq.float() * w_scale).t() - x @ w.t()).pow(2).sum().item()
    return err


def _v_o_scale(attn, x: torch.Tensor, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """SmoothQuant between v_proj and o_proj under grouped queries: o_proj's input column (head h, channel d) is
    attention over v_proj's row (kv head of h, d), so one scale per v_proj row serves every head that reads it.
    ``x``: o_proj's inputs [T, heads * head_dim]. Returns (the scale of each v_proj row [kv * hd], the scale of
    each o_proj input column [heads * hd])."""
    v, o = attn.v_proj.weight.data, attn.o_proj.weight.data  # [kv * hd, H], [H, heads * hd]
    hd = attn.head_dim
    per_kv = (o.shape[1] // hd) // (v.shape[0] // hd)  # query heads reading one kv head
    col = torch.arange(o.shape[1])
    row = (col // hd) // per_kv * hd + col % hd  # the v_proj row each o_proj input column reads
    amax = torch.zeros(v.shape[0]).scatter_reduce(0, row, x.abs().amax(0), "amax").clamp(min=1e-5)
    wmax = torch.zeros(v.shape[0]).scatter_reduce(0, row, o.abs().amax(0), "amax").clamp(min=1e-5)
    s = (amax.pow(alpha) / wmax.pow(1 - alpha)).clamp(min=1e-5)  # [kv * hd]
    return s, s[row]


def _smooth_v_into_o(layer, x: torch.Tensor, alpha: float) -> None:
    """Folds ``_v_o_scale`` into v_proj's rows and o_proj's input columns."""
    attn = layer.self_attn
    s, cols = _v_o_scale(attn, x, alpha)
    attn.v_proj.weight.data.div_(s[:, None])
    if attn.v_proj.bias is not None:
        attn.v_proj.bias.data.div_(s)
    attn.o_proj.weight.data.mul_(cols[None, :])


def _awq_scale(x: torch.Tensor, ws, group: int, grid_points: int = 20, sample: int = 4096) -> torch.Tensor:
    """AWQ's scale search: s = mean|x|^r / mean|w|^(1-r) over r in [0, 1), the r whose quantized linears' outputs
    on the calibration inputs ``x`` [T, K] (at most ``sample`` of them, evenly spaced) come closest to the float
    ones."""
    w = torch.cat(ws, 0)  # [N, K]
    x_mean = x.abs().mean(0)
    x = _evenly(x, sample)
    ref = x @ w.t()
    wg = w.abs().reshape(w.shape[0], -1, group)
    w_mean = (wg / wg.amax(-1, keepdim=True).clamp(min=1e-8)).reshape(w.shape).mean(0)
    best, best_s = float("inf"), torch.ones_like(x_mean)
    for i in range(grid_points):
        r = i / grid_points
        s = (x_mean.pow(r) / w_mean.pow(1 - r).clamp(min=1e-4)).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        _, deq = rtn(w * s[None, :], group, False)
        err = ((x / s[None, :]) @ deq.t() - ref).pow(2).mean().item()
        if err < best:
            best, best_s = err, s
    return best_s


def _awq_clip(w: torch.Tensor, x: torch.Tensor, group: int, steps: int = 20, tokens: int = 512) -> torch.Tensor:
    """AWQ's clipping search: per (row, group) the shrink of the range in [0.5, 1] whose group output on the
    calibration inputs changes least. Returns [N, G]."""
    n, k = w.shape
    g = k // group
    xs = _evenly(x, tokens).reshape(-1, g, group)  # [T, G, g]
    wg = w.reshape(n, g, group)
    ref = torch.einsum("tgc,ngc->ntg", xs, wg)
    best_err = torch.full((n, g), float("inf"))
    best = torch.ones(n, g)
    for i in range(steps // 2 + 1):
        ratio = 1 - i / steps
        clip = torch.full((n, g), ratio)
        _, deq = rtn(w, group, False, clip)
        err = (torch.einsum("tgc,ngc->ntg", xs, deq.reshape(n, g, group)) - ref).pow(2).mean(1)  # [N, G]
        better = err < best_err
        best_err[better], best[better] = err[better], ratio
    return best


def _evenly(x: torch.Tensor, count: int) -> torch.Tensor:
    """At most ``count`` rows of ``x``, evenly spaced."""
    return x if x.shape[0] <= count else x[torch.linspace(0, x.shape[0] - 1, count).long()]
