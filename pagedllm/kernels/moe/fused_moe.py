"""The experts of a MoE layer on the GPU: align the routed pairs by expert, then two grouped GEMM launches
(gate/up with SiLU-and-mul, down with the routing weights) and the sum over each token's top-k rows."""
from __future__ import annotations

import torch

from pagedllm.kernels.moe.align import moe_align_block_size
from pagedllm.kernels.moe.configs import get_config
from pagedllm.kernels import fp8_block, int8_quant
from pagedllm.kernels.moe.grouped_gemm import BlockFp8ExpertWeights, Int8ExpertWeights, PackedExpertWeights, grouped_gemm

_QUANTIZED = (PackedExpertWeights, BlockFp8ExpertWeights, Int8ExpertWeights)  # experts held in a checkpoint's quantized layout

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def usable(x: torch.Tensor, w13, activation: str) -> bool:
    """Whether the Triton path takes these experts: 16/32-bit weights of x's type, float8 weights (upcast
    in the kernel) under a 16/32-bit activation, packed 4/8-bit experts, block-wise float8 or int8 W8A8 ones."""
    if isinstance(w13, PackedExpertWeights):
        w_ok = w13.scales.dtype == x.dtype
    elif isinstance(w13, (BlockFp8ExpertWeights, Int8ExpertWeights)):
        w_ok = True
    else:
        w_ok = (w13.dtype == x.dtype or w13.dtype == torch.float8_e4m3fn) and w13.stride(-1) == 1
    return activation == "silu" and x.dtype in SUPPORTED_DTYPES and w_ok and x.dim() == 2 and x.stride(-1) == 1


def fused_experts(
    hidden_states: torch.Tensor,  # [T, H]
    w13,  # [E, 2I, H]: a tensor, or PackedExpertWeights, BlockFp8ExpertWeights, Int8ExpertWeights
    w2,  # [E, H, I], as w13
    topk_weights: torch.Tensor,  # [T, K] float32
    topk_ids: torch.Tensor,  # [T, K] int32
    config: dict[str, int] | None = None,
    w13_scale: torch.Tensor | None = None,  # [E, 2I] float32 when w13 is float8
    w2_scale: torch.Tensor | None = None,  # [E, H] float32 when w2 is float8
) -> torch.Tensor:  # [T, H]
    """sum_k w[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)) with e = ids[t, k], as ``fused_experts_ref``.

    The top-k sum is a separate reduction over a [T, K, H] buffer rather than atomic adds in the down
    launch: each token's rows are summed in slot order, so a step's result never depends on the order
    in which programs finish (CUDA-graph replays and eager steps agree bit for bit).
    """
    tokens, hidden = hidden_states.shape
    num_experts, two_i, _ = w13.shape
    top_k = topk_ids.shape[1]
    if tokens == 0:
        return torch.zeros_like(hidden_states)
    # The tuned tables hold 16-bit experts' tiles; quantized experts take the rows-per-expert table.
    shape = None if isinstance(w13, _QUANTIZED) else (two_i // 2, hidden)
    config = config or get_config(tokens, top_k, num_experts, hidden_states.dtype, shape=shape,
                                  block_fp8=isinstance(w13, BlockFp8ExpertWeights))
    sorted_ids, expert_ids, num_padded = moe_align_block_size(topk_ids.to(torch.int32), num_experts,
                                                              config["BLOCK_M"])
    num_pairs = tokens * top_k
    act = torch.empty(num_pairs, two_i // 2, dtype=hidden_states.dtype, device=hidden_states.device)
    a, a_scale, a_zero = _product_input(hidden_states, w13)
    grouped_gemm(a, w13, act, None, sorted_ids, expert_ids, num_padded, top_k, config, gated=True,
                 w_scale=w13_scale, a_scale=a_scale, a_zero=a_zero)
    down = torch.empty(num_pairs, hidden, dtype=hidden_states.dtype, device=hidden_states.device)
    a, a_scale, a_zero = _product_input(act, w2)
    grouped_gemm(a, w2, down, topk_weights.reshape(-1).float().contiguous(), sorted_ids, expert_ids, num_padded,
                 1, config, gated=False, w_scale=w2_scale, a_scale=a_scale, a_zero=a_zero)
    if top_k == 1:
        return down
    return down.view(tokens, top_k, hidden).sum(dim=1)



def _product_input(
    x: torch.Tensor,  # [rows, K]
    w,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:  # (rows as the kernel reads them, their
    # scales [rows, groups] or None, their zero points [rows, 1] or None)
    """Block-wise float8 experts take their input rows quantized to float8 per group of a block's inputs, as the
    per-expert linears (``Fp8BlockLinearMethod``) quantize theirs; int8 experts take them as int8 rows with a scale
    each (``w8a8_linear``'s quantization, bit for bit: one launch, with a zero point per row when the experts'
    activations are asymmetric); other experts take them as they are."""
    if isinstance(w, BlockFp8ExpertWeights):
        return *fp8_block.quantize_groups(x, w.block[1]), None
    if isinstance(w, Int8ExpertWeights):
        if w.row_sums is not None:
            if int8_quant.usable(x):
                return int8_quant.quantize_rows_with_zeros(x)
            return int8_quant.quantize_int8_rows(x, symmetric=False)
        return *int8_quant.quantize_rows(x), None
    return x, None, None
