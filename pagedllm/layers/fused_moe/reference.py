"""The torch reference of the experts' computation, one expert at a time: the oracle, and the CPU path; its
loop (``per_expert``) also runs GGUF experts' packed products."""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def gated_activation(x: torch.Tensor, activation: str) -> torch.Tensor:  # [N, 2I] -> [N, I]
    gate, up = x.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "gelu":
        return F.gelu(gate) * up
    raise ValueError(f"MoE activation must be 'silu' or 'gelu'; got {activation!r}")


def fused_experts_ref(
    hidden_states: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]: each expert's gate rows, then its up rows
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, K] float32
    topk_ids: torch.Tensor,  # [T, K] integer expert ids
    activation: str = "silu",
    w13_scale: torch.Tensor | None = None,  # [E, 2I] float32 when w13 is float8
    w2_scale: torch.Tensor | None = None,  # [E, H] float32 when w2 is float8
) -> torch.Tensor:  # [T, H]
    """sum_k w[t, k] * down_e(act(gate_e(x_t)) * up_e(x_t)) with e = ids[t, k].

    Float8 experts (with their per-row scales) are dequantized through float32 one expert at a time, so
    the reference never holds more than one expert in the activation's dtype.
    """
    def expert(x: torch.Tensor, e: int) -> torch.Tensor:  # [n, H] -> [n, H]
        h = gated_activation(F.linear(x, _expert(w13, w13_scale, e, x.dtype)), activation)
        return F.linear(h, _expert(w2, w2_scale, e, x.dtype))

    return per_expert(hidden_states, topk_weights, topk_ids, w13.shape[0], expert)


def per_expert(
    hidden_states: torch.Tensor,  # [T, H]
    topk_weights: torch.Tensor,  # [T, K] float32
    topk_ids: torch.Tensor,  # [T, K] integer expert ids in [0, num_experts)
    num_experts: int,
    expert: Callable[[torch.Tensor, int], torch.Tensor],  # (rows [n, H], expert id) -> that expert's output [n, H]
) -> torch.Tensor:  # [T, H]
    """sum_k w[t, k] * expert(x_t, ids[t, k]): each expert called once, on the rows of the tokens that chose it.

    Experts are visited in increasing id and their rows added in that order, so every token sums its
    experts' outputs lowest id first, as HF transformers' loop does; an expert no token chose costs nothing.
    """
    out = torch.zeros_like(hidden_states)
    if hidden_states.shape[0] == 0:
        return out
    flat_ids = topk_ids.reshape(-1).long()
    order = torch.argsort(flat_ids, stable=True)  # [T*K] (token, slot) pairs grouped by expert
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()  # one host sync per layer
    top_k = topk_ids.shape[1]
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        pairs = order[start:start + n]
        start += n
        tokens = pairs // top_k
        h = expert(hidden_states[tokens], e)
        weights = topk_weights.reshape(-1)[pairs].unsqueeze(-1)
        out.index_add_(0, tokens, (h * weights).to(out.dtype))
    return out


def _expert(
    w: torch.Tensor,  # [E, N, K]
    scale: torch.Tensor | None,  # [E, N] float32, or None for unquantized weights
    expert: int,
    dtype: torch.dtype,
) -> torch.Tensor:  # [N, K] in dtype
    if scale is None:
        return w[expert]
    return (w[expert].float() * scale[expert].float()[:, None]).to(dtype)
