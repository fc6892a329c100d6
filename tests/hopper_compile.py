"""Compiles the engine's Triton kernels for Hopper (sm_90) on any machine, as launched with PDL on.

Run as a script in a process without TRITON_INTERPRET: each host wrapper is called with small CPU
tensors while the kernels' ``run`` is replaced by a recorder, and every recorded launch is compiled to
PTX for compute capability 9.0 with Triton's bundled ptxas. Prints one JSON line per launch:
{"kernel", "wait", "trigger", "half_fma"} with the number of griddepcontrol.wait / launch_dependents
and of half-precision fused multiply-adds in the PTX.

``--inline-ptx``: the launches whose kernels carry inline PTX of their own (the W4A16 GEMV, tiles and grouped MoE
experts on pairs of 16-bit values), one JSON line each with the packed half-precision instructions in the compiled PTX: {"kernel",
"variant", "half2"}.

``--shared-memory``: the quantized products' launches instead (the grouped MoE GEMM over packed 4/8-bit, int8 and
block-float8 experts at every tile config of its table, the block-float8 GEMM at each row tile), one JSON line
each with the shared memory the compiled kernel needs: {"kernel", "variant", "shared"}.
"""
from __future__ import annotations

import json
import sys

import torch

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
           torch.float8_e4m3fn: "fp8e4nv",
           torch.int64: "i64", torch.int8: "i8"}
_OPTIONS = {"num_warps", "num_stages", "num_ctas", "launch_pdl", "maxnreg"}


def _record(kernel, launches: list) -> None:
    def run(*args, grid, warmup, **kwargs):
        launches.append((kernel, args, kwargs))

    kernel.run = run


def _compile(kernel, args, kwargs) -> str:
    return _compiled(kernel, args, kwargs).asm["ptx"]


def _compiled(kernel, args, kwargs, specialize: bool = False):
    """One recorded launch compiled for sm_90. ``specialize``: pointers 16-byte aligned and integers divisible by
    16 marked so, as Triton specializes a launch on a GPU (vectorized loads)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, constexprs, attrs = {}, {}, {}
    values = {p.name: p.default for p in kernel.params if p.has_default}  # constexprs the launch leaves out
    values.update(zip(kernel.arg_names, args))
    values.update({k: v for k, v in kwargs.items() if k not in _OPTIONS})
    for i, name in enumerate(kernel.arg_names):
        value = values[name]
        if i in kernel.constexprs:
            signature[name], constexprs[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + _DTYPES[value.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i32" if abs(value) < 2**31 else "i64"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "fp32"
    options = {k: v for k, v in kwargs.items() if k in _OPTIONS}
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs if specialize else None),
                          target=GPUTarget("cuda", 90, 32), options=options)


def shared_memory() -> None:
    """Compiles the quantized products' launches for sm_90 and prints the shared memory each needs."""
    from pagedllm.kernels import fp8_block
    from pagedllm.kernels.moe import grouped_gemm as gg
    from pagedllm.kernels.moe.configs import _TABLE
    import pagedllm.kernels.numerics as km

    km._compiled_for_nvidia = lambda t: True  # the explicitly rounded epilogues that run there
    launches: list = []
    for kernel in (gg._grouped_gemm_kernel, fp8_block._fp8_block_gemm_kernel):
        _record(kernel, launches)
    bf, e, h, i = torch.bfloat16, 4, 512, 256
    experts = {  # name -> (gate/up weights, down weights, input dtype: float8 groups, int8 rows or bf16)
        "w4 act-order": (gg.PackedExpertWeights(torch.zeros(e, h // 8, 2 * i, dtype=torch.int32),
                                                torch.zeros(e, h // 32, 2 * i, dtype=bf), torch.zeros(e, h // 32, 2 * i),
                                                torch.zeros(e, 2, h, dtype=torch.int32), 4, 32),
                         gg.PackedExpertWeights(torch.zeros(e, i // 8, h, dtype=torch.int32),
                                                torch.zeros(e, i // 32, h, dtype=bf), torch.zeros(e, i // 32, h),
                                                torch.zeros(e, 1, i, dtype=torch.int32), 4, 32), "bf16"),
        "w8 g32": (gg.PackedExpertWeights(torch.zeros(e, h // 4, 2 * i, dtype=torch.int32),
                                          torch.zeros(e, h // 32, 2 * i, dtype=bf), torch.zeros(e, h // 32, 2 * i),
                                          None, 8, 32),
                   gg.PackedExpertWeights(torch.zeros(e, i // 4, h, dtype=torch.int32),
                                          torch.zeros(e, i // 32, h, dtype=bf), torch.zeros(e, i // 32, h), None, 8, 32),
                   "bf16"),
        "fp8 block": (gg.BlockFp8ExpertWeights(torch.zeros(e, 2 * i, h, dtype=torch.float8_e4m3fn),
                                               torch.zeros(e, 2 * i // 128, h // 128), (128, 128)),
                      gg.BlockFp8ExpertWeights(torch.zeros(e, h, i, dtype=torch.float8_e4m3fn),
                                               torch.zeros(e, h // 128, i // 128), (128, 128)), "fp8"),
        # Activations with zero points: the longer int8 epilogue (a symmetric one only drops its first steps).
        "int8 asym": (gg.Int8ExpertWeights.asymmetric(torch.zeros(e, 2 * i, h, dtype=torch.int8), torch.zeros(e, 2 * i)),
                      gg.Int8ExpertWeights.asymmetric(torch.zeros(e, h, i, dtype=torch.int8), torch.zeros(e, h)),
                      "int8"),
    }
    variants = []
    inputs = {"fp8": (torch.float8_e4m3fn, lambda rows, k: {"a_scale": torch.zeros(rows, k // 128)}),
              "int8": (torch.int8, lambda rows, k: {"a_scale": torch.zeros(rows, 1), "a_zero": torch.zeros(rows, 1)}), "bf16": (bf, lambda rows, k: {})}
    for name, (w13, w2, kind) in experts.items():
        for _, config in _TABLE:
            rows = 2 * config["BLOCK_M"]
            ids = torch.zeros(rows, dtype=torch.int32), torch.zeros(2, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
            dt, scales = inputs[kind]
            kw = lambda k: scales(rows, k)  # noqa: E731
            gg.grouped_gemm(torch.zeros(rows, h, dtype=dt), w13, torch.empty(rows, i, dtype=bf), None, *ids, 1, config,
                            gated=True, **kw(h))
            gg.grouped_gemm(torch.zeros(rows, i, dtype=dt), w2, torch.empty(rows, h, dtype=bf), torch.ones(rows), *ids,
                            1, config, gated=False, **kw(i))
            variants += [f"{name} gate/up BLOCK_M={config['BLOCK_M']}", f"{name} down BLOCK_M={config['BLOCK_M']}"]
    for rows in (1, 64, 1024):
        fp8_block._fp8_block_gemm_kernel[(1, 1)](
            torch.zeros(rows, h, dtype=torch.float8_e4m3fn), torch.zeros(rows, h // 128),
            torch.zeros(i, h, dtype=torch.float8_e4m3fn), torch.zeros(i // 128, h // 128), torch.empty(rows, i, dtype=bf),
            torch.empty(1), rows, i, h, h // 128, h, BN_SCALE=128, A_FP8=True, NATIVE_FP8=True, HAS_BIAS=False,
            BLOCK_M=fp8_block._tiles(rows, i)[0], BLOCK_N=fp8_block._tiles(rows, i)[1], BLOCK_K=128,
            num_warps=fp8_block._tiles(rows, i)[2], num_stages=fp8_block._tiles(rows, i)[3])
        variants.append(f"{rows} rows")
    for (kernel, args, kwargs), variant in zip(launches, variants):
        if kernel is gg._grouped_gemm_kernel and kwargs.get("W_BLOCK"):
            kwargs = {**kwargs, "NATIVE_FP8": True}  # as on the GPU
        print(json.dumps({"kernel": kernel.__name__, "variant": variant,
                          "shared": _compiled(kernel, args, kwargs).metadata.shared}), flush=True)


def inline_ptx() -> None:
    """Compiles the W4A16 launches that carry inline PTX (ptxas checks it) and counts their packed half-precision
    instructions."""
    from pagedllm.kernels import wna16, wna16_gemv
    from pagedllm.kernels.moe import grouped_gemm as gg
    from pagedllm.kernels.moe.configs import _TABLE

    def pairs(x, bits):  # as on an NVIDIA GPU
        return bits == 4 and x.dtype != torch.float32

    wna16_gemv.pairs_apply = wna16.pairs_apply = gg.pairs_apply = pairs
    launches: list = []
    for kernel in (wna16_gemv._wna16_gemv_pairs_kernel, wna16._wna16_kernel, gg._grouped_gemm_kernel):
        _record(kernel, launches)
    variants = []
    k, n = 1024, 512
    qw = torch.zeros(k // 8, n, dtype=torch.int32)
    for dt in (torch.bfloat16, torch.float16):
        s, z = torch.zeros(k // 128, n, dtype=dt), torch.zeros(k // 128, n)
        wna16_gemv.wna16_gemv(torch.zeros(1, k, dtype=dt), qw, s, z, 4, 128)
        variants.append(f"gemv {dt}")
        for m in (16, 64, 256):
            wna16.wna16_matmul(torch.zeros(m, k, dtype=dt), qw, s, z, 4, 128, dense_from_rows=1 << 30)
            variants.append(f"tiles {m} rows {dt}")
        # 4-bit experts (groups in order), gated, at the table's first tile.
        e, h, i, config = 4, 512, 256, _TABLE[0][1]
        w13 = gg.PackedExpertWeights(torch.zeros(e, h // 8, 2 * i, dtype=torch.int32), torch.zeros(e, h // 32, 2 * i,
                                     dtype=dt), torch.zeros(e, h // 32, 2 * i), None, 4, 32)
        rows = 2 * config["BLOCK_M"]
        gg.grouped_gemm(torch.zeros(rows, h, dtype=dt), w13, torch.empty(rows, i, dtype=dt), None,
                        torch.zeros(rows, dtype=torch.int32), torch.zeros(2, dtype=torch.int32),
                        torch.zeros(1, dtype=torch.int32), 1, config, gated=True)
        variants.append(f"experts {dt}")
    for (kernel, args, kwargs), variant in zip(launches, variants):
        ptx = _compile(kernel, args, kwargs)
        print(json.dumps({"kernel": kernel.__name__, "variant": variant,
                          "half2": ptx.count("bf16x2") + ptx.count("f16x2")}), flush=True)


def main() -> None:
    import pagedllm.kernels.launch as kl

    kl.use_pdl = lambda t: True  # as on an H200 with PAGEDLLM_PDL=1
    import pagedllm.kernels.numerics as km

    km._compiled_for_nvidia = lambda t: True  # the explicitly rounded variants that run there
    from paged_batches import build_paged_batch
    from pagedllm.attention.backends.triton import TritonImpl
    from pagedllm.kernels.attention import decode_pieces as dp
    from pagedllm.kernels.attention import paged_attention as pa
    from pagedllm.kernels.attention import reshape_and_cache as rc
    from pagedllm.kernels import activation, fp8_quant, gemv, int8_gemm, int8_quant, qk_norm_rotary, rmsnorm, rotary
    from pagedllm.kernels import skinny_gemm
    from pagedllm.kernels.row_quant import QuantizedRows
    from pagedllm.layers.norm import RMSNorm
    from pagedllm.kernels.attention.fused_inputs import Rope
    from pagedllm.kernels.sampling import argmax as argmax_triton

    launches: list = []
    for kernel in (gemv._gemv_kernel, skinny_gemm._skinny_gemm_kernel, rmsnorm._rmsnorm_kernel, activation._act_and_mul_kernel, rotary._rotary_kernel,
                   qk_norm_rotary._qk_norm_rotary_kernel, rc._reshape_and_cache_kernel, pa._paged_attention_kernel,
                   pa._reduce_splits_kernel, dp._piece_ends_kernel, dp._decode_pieces_kernel, fp8_quant._quant_rows_kernel,
                   activation._act_and_mul_quant_kernel, argmax_triton._chunk_argmax_kernel,
                   argmax_triton._row_argmax_kernel, int8_gemm._w8a8_kernel, int8_quant._quant_rows_kernel,
                   int8_quant._scale_rows_kernel):
        _record(kernel, launches)
    bf = torch.bfloat16
    gemv.gemv(torch.zeros(1, 1024, dtype=bf), torch.zeros(64, 1024, dtype=bf))
    # A float8 weight with row scales, and the activation quantizer of the float8 products.
    gemv.gemv(torch.zeros(1, 1024, dtype=bf), torch.zeros(64, 1024, dtype=torch.float8_e4m3fn), scale=torch.ones(64))
    fp8_quant.quantize_rows(torch.zeros(16, 1024, dtype=bf))
    skinny_gemm.skinny_gemm(torch.zeros(16, 1024, dtype=bf), torch.zeros(1024, 1024, dtype=torch.float8_e4m3fn),
                            scale=torch.ones(1024))
    # Swapped tiles (weight rows as the left operand), as 17-64 rows over a deep float8 weight take them.
    skinny_gemm.skinny_gemm(torch.zeros(16, 4096, dtype=bf), torch.zeros(1024, 4096, dtype=torch.float8_e4m3fn),
                            scale=torch.ones(1024), config=skinny_gemm.default_config(32, 1024, 4096))
    # Norms and activations that store a float8 or W8A8 linear's input quantized; one such int8 row read by the
    # W8A8 decode kernel with its K split.
    for kind in ("fp8", "int8", "int8_zp"):
        rmsnorm.rms_norm(torch.zeros(2, 1024, dtype=bf), torch.ones(1024, dtype=bf), 1e-6,
                         torch.zeros(2, 1024, dtype=bf), quantize=kind)
        activation.act_and_mul(torch.zeros(2, 2048, dtype=bf), "silu", quantize=kind)
    rows = QuantizedRows(*int8_quant.quantize_rows(torch.zeros(1, 4096, dtype=bf)), bf)
    int8_gemm.w8a8_decode(rows, torch.zeros(4096, 4096, dtype=torch.int8), torch.ones(4096), split_k=2)
    # W8A8 rows with a zero point each: their quantizer, the decode kernel (from a producer's rows too) and the
    # epilogue after cuBLAS.
    sums = torch.zeros(4096)
    int8_gemm.w8a8_decode(QuantizedRows(rows.q, rows.scales, bf, torch.zeros(1, 1)),
                          torch.zeros(4096, 4096, dtype=torch.int8), torch.ones(4096), weight_row_sums=sums)
    int8_gemm.w8a8_decode(torch.zeros(2, 4096, dtype=bf), torch.zeros(4096, 4096, dtype=torch.int8), torch.ones(4096),
                          weight_row_sums=sums)
    int8_quant.scale_rows(torch.zeros(32, 4096, dtype=torch.int32), torch.ones(30, 1), torch.ones(4096), None, bf,
                          torch.zeros(30, 1), sums)
    split = skinny_gemm.GemmConfig(32, 32, 128, 4, 3, 4)  # the in-launch sum of a K split
    skinny_gemm.skinny_gemm(torch.zeros(16, 1024, dtype=bf), torch.zeros(1024, 1024, dtype=torch.float8_e4m3fn),
                            config=split, scale=torch.ones(1024))
    rmsnorm.rms_norm(torch.zeros(1, 1024, dtype=bf), torch.ones(1024, dtype=bf), 1e-6, torch.zeros(1, 1024, dtype=bf))
    activation.act_and_mul(torch.zeros(1, 2048, dtype=bf), "silu")
    argmax_triton.argmax_rows_triton(torch.zeros(2, 151936, dtype=bf))
    pos = torch.zeros(2, dtype=torch.int64)
    q, k = torch.zeros(2, 4 * 64, dtype=bf), torch.zeros(2, 2 * 64, dtype=bf)
    rotary.rotary_neox_(pos, q, k, torch.ones(32), 64)
    norm = RMSNorm(64, params_dtype=bf)
    qk_norm_rotary.qk_norm_rotary_(pos, q, k, norm.weight, norm.weight, 1e-6, 1e-6, torch.ones(32), 64)
    # ... storing keys and values into a paged cache in the same launch (bf16, and a float8 cache).
    for cache_dtype in (bf, torch.float8_e4m3fn):
        kc = torch.zeros(4, 16, 2, 64, dtype=cache_dtype)
        write = qk_norm_rotary.KVCacheWrite(torch.zeros(2, 2 * 64, dtype=bf), kc, kc.clone(), torch.zeros(2, dtype=torch.int64))
        qk_norm_rotary.qk_norm_rotary_(pos, q, k, norm.weight, norm.weight, 1e-6, 1e-6, torch.ones(32), 64, cache=write)
    # Pure-decode batches (fused write and rotary, split and not) and a mixed one (separate cache write).
    for reqs, splits, rope in (([(200, 1), (70, 1)], 4, True), ([(9, 1), (3, 1)], 1, True),
                               ([(5, 6), (3, 1)], 1, False)):
        query, key, value, cache, _, metadata = build_paged_batch(reqs, 4, 2, 64, 16, bf, 0)
        impl = TritonImpl(4, 64, 0.125, 2, None, None)
        impl.num_splits = splits
        impl.forward(query, key, value, cache, metadata(), rope=Rope(torch.ones(32), 1.0) if rope else None)
    # Decode in pieces: a float8 cache with programs enough (one warp a program).
    query, key, value, cache, _, metadata = build_paged_batch([(300, 1)] * 1000, 4, 2, 128, 16, bf, 0,
                                                              cache_dtype=torch.float8_e4m3fn)
    impl = TritonImpl(4, 128, 0.125, 2, None, None)
    assert impl._uses_pieces(metadata(), query, cache[0])
    impl.forward(query, key, value, cache, metadata(), rope=Rope(torch.ones(64), 1.0))
    for kernel, args, kwargs in launches:
        ptx = _compile(kernel, args, kwargs)
        print(json.dumps({"kernel": kernel.__name__, "pdl": bool(kwargs.get("launch_pdl")),
                          "wait": ptx.count("griddepcontrol.wait"),
                          "trigger": ptx.count("griddepcontrol.launch_dependents"),
                          "half_fma": ptx.count("fma.rn.f16") + ptx.count("fma.rn.bf16")}), flush=True)


if __name__ == "__main__":
    sys.exit(shared_memory() if "--shared-memory" in sys.argv else inline_ptx() if "--inline-ptx" in sys.argv else main())
