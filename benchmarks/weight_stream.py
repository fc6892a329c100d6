"""How fast one persistent CUDA kernel can stream a decode step's weights, product after product, across grid barriers.

``persistent_chain.py`` found that Triton programs pay a product's first-load latency at every item and
drain their pipelines at its end, so a layer's four products take 3-4× their bytes' time even with no
barrier between them. This asks what the other design would reach: each block keeps one ring of
shared-memory stages filled by ``cp.async`` without pause, the next product's weights already in flight
while the block waits at the grid barrier, reads that product's activations from L2 and goes on.

Per layer, Qwen3-0.6B's four products (qkv, o, gate_up, down: 31.5 MiB of bf16 weights), 28 layers; each
product's weights split into 4 KiB chunks taken round robin by the blocks, and before each product every
block reads its activations (16 rows by the product's input width) written before the barrier. The
weights are only summed, not multiplied: at 16 rows the products' arithmetic is ~1% of the tensor cores'
rate, so this is the floor of a fused kernel's product time. Each layout is timed with and without the
barriers and with and without the activation reads. Two kernels: ``ring``, whose threads copy and use
the chunks in one loop, and ``producer``, where one lane of an extra warp issues bulk copies completing
on per-slot mbarriers while the other warps use the chunks and alone take the grid barrier. CUDA C
compiled at run time by NVRTC (``torch.cuda._compile_kernel``).

    python3 benchmarks/weight_stream.py [--stages 8,16] [--producer-stages 16,48] [--blocks-per-sm 1,2,4] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

THREADS = 256
CHUNK = THREADS * 16  # bytes a block moves per stage: 16 per thread
# (weight rows, input width) of Qwen3-0.6B's products, in layer order.
QWEN_PRODUCTS = ((4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072))
ROWS = 16

SOURCE = r"""
#define STAGES %(stages)d
#define THREADS %(threads)d

struct u4 { unsigned x, y, z, w; };

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    unsigned r;
    asm volatile("{ .reg .u64 t; cvta.to.shared.u64 t, %%1; cvt.u32.u64 %%0, t; }" : "=r"(r) : "l"(p));
    return r;
}

__device__ __forceinline__ void copy16(unsigned dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%%0], [%%1], 16;" :: "r"(dst), "l"(src) : "memory");
}

__device__ __forceinline__ u4 load_l2(const u4* p) {
    u4 v;
    asm volatile("ld.global.cg.v4.u32 {%%0, %%1, %%2, %%3}, [%%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
    return v;
}

// Polls with plain acquire loads: an atomic per poll from every block would queue the arrivals behind them.
__device__ __forceinline__ unsigned load_acquire(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %%0, [%%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ unsigned long long now_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %%0, %%globaltimer;" : "=l"(t));
    return t;
}

// One thread of a block: arrive, then wait for all. Every block arrives once per barrier; the count only
// grows, so barrier k waits for k * gridDim.x. A barrier that waits too long (blocks not all resident)
// sets *err and lets the launch run out.
__device__ __forceinline__ void arrive_and_wait(unsigned* count, unsigned target, unsigned* err) {
    __threadfence();
    atomicAdd(count, 1u);
    int spins = 0;
    while (load_acquire(count) < target && *((volatile unsigned*)err) == 0u) {
        if (++spins == (1 << 22)) atomicExch(err, 1u);
    }
    __threadfence();
}

// ``stamp`` (or null): where to record the block's arrival and release times (ns).
__device__ __forceinline__ void grid_sync(unsigned* count, unsigned target, unsigned* err,
                                          unsigned long long* stamp) {
    __syncthreads();
    if (threadIdx.x == 0) {
        if (stamp) stamp[0] = now_ns();
        arrive_and_wait(count, target, err);
        if (stamp) stamp[1] = now_ns();
    }
    __syncthreads();
}

extern "C" __global__ void __launch_bounds__(THREADS) stream_chain_ring(
    const u4* __restrict__ w,              // every product's weights, one after another
    const long long* __restrict__ starts,  // [P] first chunk of each product
    const int* __restrict__ per_block,     // [P] chunks each block takes of each product
    const u4* __restrict__ x,              // activations, product after product
    const long long* __restrict__ x_start, // [P] first chunk of each product's activations
    const int* __restrict__ x_chunks,      // [P] chunks of each product's activations
    u4* __restrict__ out,                  // [gridDim.x * THREADS]
    unsigned* count,                       // zero on entry
    unsigned* err,                         // zero on entry; 1 if a barrier gave up
    int products, int barrier,             // barrier 2: also record each block's times at each barrier
    unsigned long long* stamps)            // (barrier 2) [P][gridDim.x][2] arrival and release, ns
{
    extern __shared__ u4 ring[];           // [STAGES][THREADS]
    const int t = threadIdx.x;
    const long long G = gridDim.x;
    // The load cursor runs STAGES - 1 chunks ahead of use, across product boundaries: the next
    // product's weights are in flight while the block waits at the barrier.
    int lp = 0, li = 0;
    for (int s = 0; s < STAGES - 1; ++s) {
        if (lp < products) {
            copy16(smem_addr(&ring[s * THREADS + t]), w + (starts[lp] + blockIdx.x + li * G) * THREADS + t);
            if (++li == per_block[lp]) { li = 0; ++lp; }
        }
        asm volatile("cp.async.commit_group;" ::: "memory");
    }
    u4 acc = {0u, 0u, 0u, 0u};
    int stage = 0;
    for (int p = 0; p < products; ++p) {
        if (barrier && p > 0)
            grid_sync(count, (unsigned)(p * G), err, barrier == 2 ? stamps + (p * G + blockIdx.x) * 2 : nullptr);
        // Eight loads in flight before their first use: one at a time, each would cost an L2 round trip.
        const u4* xp = x + x_start[p] * THREADS + t;
        for (int c = 0; c < x_chunks[p]; c += 8) {
            u4 v[8];
            #pragma unroll
            for (int j = 0; j < 8; ++j) if (c + j < x_chunks[p]) v[j] = load_l2(xp + (c + j) * THREADS);
            #pragma unroll
            for (int j = 0; j < 8; ++j) if (c + j < x_chunks[p]) { acc.x ^= v[j].x; acc.y ^= v[j].y; acc.z ^= v[j].z; acc.w ^= v[j].w; }
        }
        for (int i = 0; i < per_block[p]; ++i) {
            asm volatile("cp.async.wait_group %%0;" :: "n"(STAGES - 2) : "memory");
            __syncthreads();
            u4 v = ring[stage * THREADS + t];
            acc.x += v.x; acc.y += v.y; acc.z += v.z; acc.w += v.w;
            __syncthreads();
            if (lp < products) {
                int slot = (stage + STAGES - 1) %% STAGES;
                copy16(smem_addr(&ring[slot * THREADS + t]), w + (starts[lp] + blockIdx.x + li * G) * THREADS + t);
                if (++li == per_block[lp]) { li = 0; ++lp; }
            }
            asm volatile("cp.async.commit_group;" ::: "memory");
            stage = (stage + 1) %% STAGES;
        }
    }
    asm volatile("cp.async.wait_all;" ::: "memory");
    out[blockIdx.x * THREADS + t] = acc;
}
"""


# The other design: a producer warp copies chunks into the ring with Hopper's bulk copies, each completing
# on the slot's "full" mbarrier, and refills a slot as soon as the consumer warps have all arrived on its
# "empty" one. The consumers alone take the grid barrier (a named barrier among them), so the producer
# goes on filling free slots while they wait.
SOURCE_PRODUCER = r"""
__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%%0], %%1;" :: "r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_arrive(unsigned bar) {
    asm volatile("{ .reg .b64 st; mbarrier.arrive.shared::cta.b64 st, [%%0]; }" :: "r"(bar) : "memory");
}

__device__ __forceinline__ void mbar_expect(unsigned bar, unsigned bytes) {
    asm volatile("{ .reg .b64 st; mbarrier.arrive.expect_tx.shared::cta.b64 st, [%%0], %%1; }"
                 :: "r"(bar), "r"(bytes) : "memory");
}

// Wait for the phase of the given parity to complete; false (and *err set) after too long.
__device__ __forceinline__ bool mbar_wait(unsigned bar, unsigned parity, unsigned* err) {
    for (int n = 0; ; ++n) {
        unsigned ok;
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%%1], %%2; selp.u32 %%0, 1, 0, p; }"
                     : "=r"(ok) : "r"(bar), "r"(parity) : "memory");
        if (ok) return true;
        if (n == (1 << 24)) { atomicExch(err, 2u); return false; }
    }
}

__device__ __forceinline__ void bulk_copy(unsigned dst, const void* src, unsigned bytes, unsigned bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%%0], [%%1], %%2, [%%3];"
                 :: "r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

// Among the consumer warps only (named barrier 1), so that the producer warp keeps copying meanwhile.
__device__ __forceinline__ void consumer_grid_sync(unsigned* count, unsigned target, unsigned* err) {
    asm volatile("bar.sync 1, %%0;" :: "n"(THREADS) : "memory");
    if (threadIdx.x == 0) arrive_and_wait(count, target, err);
    asm volatile("bar.sync 1, %%0;" :: "n"(THREADS) : "memory");
}

extern "C" __global__ void __launch_bounds__(THREADS + 32) stream_chain_producer(
    const u4* __restrict__ w, const long long* __restrict__ starts, const int* __restrict__ per_block,
    const u4* __restrict__ x, const long long* __restrict__ x_start, const int* __restrict__ x_chunks,
    u4* __restrict__ out, unsigned* count, unsigned* err, int products, int barrier, unsigned long long* stamps)
{
    extern __shared__ __align__(128) unsigned char smem[];
    u4* ring = (u4*)smem;                                                // [STAGES][THREADS]
    unsigned long long* full = (unsigned long long*)(smem + STAGES * THREADS * 16);
    unsigned long long* empty = full + STAGES;
    const long long G = gridDim.x;
    const int t = threadIdx.x;
    if (t == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(smem_addr(&full[s]), 1u);
            mbar_init(smem_addr(&empty[s]), THREADS / 32);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (t >= THREADS) {  // the producer warp: one lane issues every copy
        if (t == THREADS) {
            long long j = 0;
            for (int p = 0; p < products; ++p) {
                for (int i = 0; i < per_block[p]; ++i, ++j) {
                    int s = (int)(j %% STAGES);
                    unsigned round = (unsigned)(j / STAGES);
                    if (round > 0 && !mbar_wait(smem_addr(&empty[s]), (round - 1u) & 1u, err)) return;
                    mbar_expect(smem_addr(&full[s]), THREADS * 16);
                    bulk_copy(smem_addr(&ring[s * THREADS]), w + (starts[p] + blockIdx.x + i * G) * THREADS,
                              THREADS * 16, smem_addr(&full[s]));
                }
            }
        }
        return;
    }
    u4 acc = {0u, 0u, 0u, 0u};
    long long j = 0;
    for (int p = 0; p < products; ++p) {
        if (barrier && p > 0) consumer_grid_sync(count, (unsigned)(p * G), err);
        const u4* xp = x + x_start[p] * THREADS + t;
        for (int c = 0; c < x_chunks[p]; c += 8) {
            u4 v[8];
            #pragma unroll
            for (int k = 0; k < 8; ++k) if (c + k < x_chunks[p]) v[k] = load_l2(xp + (c + k) * THREADS);
            #pragma unroll
            for (int k = 0; k < 8; ++k) if (c + k < x_chunks[p]) { acc.x ^= v[k].x; acc.y ^= v[k].y; acc.z ^= v[k].z; acc.w ^= v[k].w; }
        }
        for (int i = 0; i < per_block[p]; ++i, ++j) {
            int s = (int)(j %% STAGES);
            if (!mbar_wait(smem_addr(&full[s]), (unsigned)(j / STAGES) & 1u, err)) { p = products; break; }
            u4 v = ring[s * THREADS + t];
            acc.x += v.x; acc.y += v.y; acc.z += v.z; acc.w += v.w;
            __syncwarp();
            if ((t & 31) == 0) mbar_arrive(smem_addr(&empty[s]));
        }
    }
    out[blockIdx.x * THREADS + t] = acc;
}
"""

KERNELS = {"ring": "stream_chain_ring", "producer": "stream_chain_producer"}


def source(stages: int, kernel: str = "ring") -> str:
    text = SOURCE + (SOURCE_PRODUCER if kernel == "producer" else "")
    return text % {"stages": stages, "threads": THREADS}


def shared_bytes(stages: int, kernel: str) -> int:
    return stages * CHUNK + (2 * stages * 8 if kernel == "producer" else 0)


class Layout:
    """The products' chunk ranges (each rounded up to a multiple of the grid) and activation ranges."""

    def __init__(self, blocks: int, layers: int = 28, products=QWEN_PRODUCTS, rows: int = ROWS):
        self.blocks = blocks
        starts, per_block, x_start, x_chunks = [], [], [], []
        w_next = x_next = 0
        for _ in range(layers):
            for n, k in products:
                chunks = -(-(n * k * 2) // CHUNK)
                per = -(-chunks // blocks)
                starts.append(w_next)
                per_block.append(per)
                w_next += per * blocks
                xc = -(-(rows * k * 2) // CHUNK)
                x_start.append(x_next)
                x_chunks.append(xc)
                x_next += xc
        self.products = len(starts)
        self.weight_chunks, self.x_chunks_total = w_next, x_next
        self.weight_bytes = sum(n * k * 2 for n, k in products) * layers
        self.tensors = [torch.tensor(starts, dtype=torch.int64), torch.tensor(per_block, dtype=torch.int32),
                        torch.tensor(x_start, dtype=torch.int64), torch.tensor(x_chunks, dtype=torch.int32)]


def allow_shared_memory(kernel, nbytes: int) -> None:
    """Let the compiled kernel take ``nbytes`` of dynamic shared memory (the driver's opt-in above 48 KiB)."""
    if nbytes < 48 * 1024:
        return
    libcuda = torch.cuda._utils._get_gpu_runtime_library()
    max_dynamic_shared_size_bytes = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    assert libcuda.cuFuncSetAttribute(kernel.func, max_dynamic_shared_size_bytes, nbytes) == 0
    kernel._max_shared_mem_bytes = nbytes  # what newer torch's launch check reads


def barrier_times(kernel, lay: Layout, smem: int, threads: int, args: list, stamps: torch.Tensor, case: dict) -> None:
    """One more launch recording when each block reached each barrier and when it left: how far apart the
    blocks arrive (the slowest block's lateness) against how long the release takes after the last."""
    stamps.zero_()
    args[7].zero_()  # the barrier count
    kernel(grid=(lay.blocks, 1, 1), block=(threads, 1, 1), shared_mem=smem, args=args + [lay.products, 2, stamps])
    torch.cuda.synchronize()
    t = stamps.view(lay.products, lay.blocks, 2)[1:].double()  # barriers 1..P-1
    arrive, leave = t[..., 0], t[..., 1]
    spread = (arrive.max(1).values - arrive.min(1).values).mean().item() / 1e3
    mean_wait = (arrive.max(1).values - arrive.mean(1)).mean().item() / 1e3
    release = (leave.min(1).values - arrive.max(1).values).mean().item() / 1e3
    case.update(arrival_spread_us=spread, mean_block_wait_us=mean_wait, release_after_last_us=release)
    print(f"          barrier: arrivals spread {spread:5.2f} µs (a block waits {mean_wait:5.2f} µs on average for the "
          f"last), release {release:5.2f} µs after the last", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stages", default="8,16", help="ring stages of the one-loop kernel")
    ap.add_argument("--producer-stages", default="16,48", help="ring stages of the producer-warp kernel")
    ap.add_argument("--blocks-per-sm", default="1,2,4")
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "weight_stream.json"))
    args = ap.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from linear_shapes import graph_time_us

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    results = {"device": torch.cuda.get_device_name(), "cases": []}
    print("kernel    stages  blocks  barrier  read_x  µs a layer  weight TB/s")
    plan = [("ring", int(st)) for st in args.stages.split(",") if st] + \
        [("producer", int(st)) for st in args.producer_stages.split(",") if st]
    for name, stages in plan:
        kernel = torch.cuda._compile_kernel(source(stages, name), KERNELS[name])
        smem = shared_bytes(stages, name)
        allow_shared_memory(kernel, smem)
        threads = THREADS + (32 if name == "producer" else 0)
        for per_sm in [int(b) for b in args.blocks_per_sm.split(",")]:
            if per_sm * smem > 220 * 1024:
                continue
            lay = Layout(per_sm * sms)
            w = torch.randint(-2**31, 2**31 - 1, (lay.weight_chunks * CHUNK // 4,), dtype=torch.int32, device="cuda")
            x = torch.randint(-2**31, 2**31 - 1, (lay.x_chunks_total * CHUNK // 4,), dtype=torch.int32, device="cuda")
            out = torch.zeros(lay.blocks * THREADS * 4, dtype=torch.int32, device="cuda")
            count = torch.zeros(1, dtype=torch.int32, device="cuda")
            err = torch.zeros(1, dtype=torch.int32, device="cuda")
            meta = [t.cuda() for t in lay.tensors]
            no_x = torch.zeros_like(meta[3])
            stamps = torch.zeros(lay.products * lay.blocks * 2, dtype=torch.int64, device="cuda")
            for barrier, read_x in ((1, 1), (0, 1), (1, 0), (0, 0)):
                def run():
                    count.zero_()
                    kernel(grid=(lay.blocks, 1, 1), block=(threads, 1, 1), shared_mem=smem,
                           args=[w, meta[0], meta[1], x, meta[2], meta[3] if read_x else no_x, out, count, err,
                                 lay.products, barrier, stamps])
                run()
                torch.cuda.synchronize()
                if err.item():
                    print(f"{name:8s}  {stages:6d}  {lay.blocks:6d}: a wait gave up (err {err.item()})", flush=True)
                    break
                if barrier:
                    assert count.item() == (lay.products - 1) * lay.blocks
                us = graph_time_us(run) / (lay.products / 4)
                tbps = lay.weight_bytes / (lay.products / 4) / (us * 1e-6) / 1e12
                results["cases"].append({"kernel": name, "stages": stages, "blocks": lay.blocks, "barrier": barrier,
                                         "read_x": read_x, "us_per_layer": us, "weight_tbps": tbps})
                print(f"{name:8s}  {stages:6d}  {lay.blocks:6d}  {barrier:7d}  {read_x:6d}  {us:10.2f}  {tbps:11.2f}",
                      flush=True)
                if barrier and name == "ring":
                    barrier_times(kernel, lay, smem, threads, [w, meta[0], meta[1], x, meta[2],
                                  meta[3] if read_x else no_x, out, count, err], stamps, results["cases"][-1])
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
