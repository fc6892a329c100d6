"""The split-KV reduction: merges a request's partial attention outputs (flash-decoding's second pass)."""
from __future__ import annotations

import triton
import triton.language as tl

from pagedllm.kernels.launch import wait_for_previous_kernel


@triton.jit(do_not_specialize=["num_splits"])
def _reduce_splits_kernel(
    out_ptr,  # [T, Hq, D]
    part_acc_ptr,  # [T, Hq, num_splits, D] fp32
    part_ml_ptr,  # [T, Hq, num_splits, 2] fp32
    num_q_heads,
    num_splits,
    stride_ot, stride_oh,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_P2: tl.constexpr,
    SPLITS_P2: tl.constexpr,
    USE_GDC: tl.constexpr,  # launched with PDL: wait for the previous kernel first (kernels/launch.py)
):
    wait_for_previous_kernel(USE_GDC, True)
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_P2)  # [SPLITS_P2]
    split_valid = splits < num_splits
    dims = tl.arange(0, HEAD_SIZE_P2)  # [HEAD_SIZE_P2]
    dim_valid = dims < HEAD_SIZE
    part_row = (tok * num_q_heads + head) * num_splits + splits  # [SPLITS_P2]

    m = tl.load(part_ml_ptr + part_row * 2, mask=split_valid, other=float("-inf"))  # [SPLITS_P2]
    l = tl.load(part_ml_ptr + part_row * 2 + 1, mask=split_valid, other=0.0)  # [SPLITS_P2]
    m_max = tl.max(m, axis=0)
    m_ref = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_ref)  # [SPLITS_P2]; empty partitions weigh 0
    acc = tl.load(  # [SPLITS_P2, HEAD_SIZE_P2]
        part_acc_ptr + part_row[:, None] * HEAD_SIZE + dims[None, :],
        mask=split_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )
    num = tl.sum(acc * w[:, None], axis=0)  # [HEAD_SIZE_P2]
    den = tl.sum(l * w, axis=0)
    den = tl.where(den == 0.0, 1.0, den)
    tl.store(
        out_ptr + tok * stride_ot + head * stride_oh + dims,
        (num / den).to(out_ptr.dtype.element_ty),
        mask=dim_valid,
    )
