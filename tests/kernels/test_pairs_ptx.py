"""The inline PTX of the W4A16 kernels on pairs of 16-bit values, run instruction by instruction by a small simulator.

Only a GPU executes that PTX, so these tests read the exact text the kernels embed (``_pair_asm``,
``_pairs_dequant_asm``) and step through it with PTX's own semantics (round-to-nearest-even packed multiply-adds,
LOP3 truth tables, register halves): the GEMV's sum of a word pair's sixteen products within its half-precision
roundings of the exact sum, and the tiles' values equal to ``(q - z) * s`` rounded once, as torch's path gives.
"""
from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

from pagedllm.kernels.wna16 import _PAIRS_DEQUANT_ASM
from pagedllm.kernels.wna16_gemv import _PAIR_ASM, PAIR_MAGIC

HALF = {torch.bfloat16: ("bf16", 8), torch.float16: ("f16", 11)}  # PTX name, significand bits


def _round(v: float, bits: int) -> float:
    """``v`` rounded to nearest-even at ``bits`` significant bits (normal range only, as in these tests)."""
    if v == 0.0:
        return v
    m, e = math.frexp(v)
    return round(m * 2.0 ** bits) * 2.0 ** (e - bits)


def _to_bits(v: float, half: str) -> int:
    if half == "bf16":
        return int(np.array(v, dtype=np.float32).view(np.uint32)) >> 16
    return int(np.array(v, dtype=np.float16).view(np.uint16))


def _from_bits(h: int, half: str) -> float:
    if half == "bf16":
        return float(np.array(h << 16, dtype=np.uint32).view(np.float32))
    return float(np.array(h, dtype=np.uint16).view(np.float16))


def _f32(v: int) -> float:
    return float(np.array(v, dtype=np.uint32).view(np.float32))


def _lop3(a: int, b: int, c: int, lut: int) -> int:
    out = 0
    for bit in range(32):
        idx = (((a >> bit) & 1) << 2) | (((b >> bit) & 1) << 1) | ((c >> bit) & 1)
        out |= ((lut >> idx) & 1) << bit
    return out


def run_ptx(asm: str, args: list[int], outputs: int, half: str, bits: int) -> list[int]:
    """Runs ``asm`` with ``$outputs..`` bound to the 32-bit ``args``; returns ``$0..$outputs-1`` as raw bits."""
    regs = {f"${outputs + i}": a & 0xFFFFFFFF for i, a in enumerate(args)}

    def val(tok: str) -> int:
        tok = tok.strip()
        return int(tok, 16) if tok.startswith("0x") else regs[tok]

    for line in asm.replace("{\n", "").replace("\n}", "").splitlines():
        line = line.strip().rstrip(";")
        if not line or line.startswith(".reg") or line in "{}":
            continue
        op, rest = line.split(None, 1)
        if op == "mov.b32" and rest.startswith("{"):  # a register's halves into two 16-bit ones
            lo, hi, src = re.match(r"\{(\S+), (\S+)\}, (\S+)", rest).groups()
            regs[lo], regs[hi] = val(src) & 0xFFFF, val(src) >> 16
            continue
        d, *ops = [t.strip() for t in rest.split(",")]
        if op == "mov.b32":
            regs[d] = val(ops[0])
        elif op == "shr.u32":
            regs[d] = val(ops[0]) >> int(ops[1])
        elif op == "shl.b32":
            regs[d] = (val(ops[0]) << int(ops[1])) & 0xFFFFFFFF
        elif op == "and.b32":
            regs[d] = val(ops[0]) & val(ops[1])
        elif op == "lop3.b32":
            regs[d] = _lop3(val(ops[0]), val(ops[1]), val(ops[2]), val(ops[3]))
        elif op == f"fma.rn.{half}x2":
            a, b, c = (val(t) for t in ops)
            lanes = [_to_bits(_round(_from_bits((a >> s) & 0xFFFF, half) * _from_bits((b >> s) & 0xFFFF, half)
                                     + _from_bits((c >> s) & 0xFFFF, half), bits), half) for s in (0, 16)]
            regs[d] = lanes[0] | (lanes[1] << 16)
        elif op == "cvt.f32.f16":
            regs[d] = int(np.array(_from_bits(val(ops[0]), "f16"), dtype=np.float32).view(np.uint32))
        elif op == "add.f32":
            regs[d] = int(np.array(np.float32(_f32(val(ops[0]))) + np.float32(_f32(val(ops[1]))),
                                   dtype=np.float32).view(np.uint32))
        else:
            raise AssertionError(f"the simulator does not know {op}")
    return [regs[f"${i}"] for i in range(outputs)]


def _pair_bits(lo: float, hi: float, half: str) -> int:
    return _to_bits(lo, half) | (_to_bits(hi, half) << 16)


def _words(rng, words: int, dtype):
    """Random 4-bit values [8 words], their int32 words and a zero point up to 16 with its ``-(M + z)`` pair."""
    q = rng.integers(0, 16, 8 * words)
    z = int(rng.integers(0, 17))
    nz = -(PAIR_MAGIC[dtype] + z)
    packed = [sum(int(q[8 * w + i]) << (4 * i) for i in range(8)) for w in range(words)]
    return q, z, packed, _pair_bits(nz, nz, HALF[dtype][0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemv_ptx_sums_a_word_pair_of_products(dtype):
    half, bits = HALF[dtype]
    rng = np.random.default_rng(7)
    for _ in range(40):
        q, z, words, nz = _words(rng, 2, dtype)
        x = [_round(float(v), bits) for v in rng.standard_normal(16)]
        xs = [_pair_bits(x[8 * w + j], x[8 * w + j + 4], half) for w in (0, 1) for j in range(4)]
        (got,) = run_ptx(_PAIR_ASM[dtype], [*words, nz, *xs], 1, half, bits)
        terms = [(q[i] - z) * x[i] for i in range(16)]
        # Two lanes of eight terms, each product and sum rounded at most once to the half precision.
        bound = 8 * 2.0 ** -bits * sum(abs(t) for t in terms) + 1e-6
        assert abs(_f32(got) - sum(terms)) <= bound, (_f32(got), sum(terms), bound)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tile_ptx_gives_the_two_step_weight(dtype):
    half, bits = HALF[dtype]
    rng = np.random.default_rng(11)
    for _ in range(40):
        q, z, (word,), nz = _words(rng, 1, dtype)
        s = _round(float(rng.uniform(0.002, 0.02)), bits)
        out = run_ptx(_PAIRS_DEQUANT_ASM[dtype], [word, nz, _pair_bits(s, s, half)], 8, half, bits)
        assert out == [_to_bits(_round((int(q[i]) - z) * s, bits), half) for i in range(8)]
