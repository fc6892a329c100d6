/* What the CPU product kernels share: the always-inlined helpers' attribute and how a product's weight rows are
   split into work items for OpenMP's dynamic schedule. */
#ifndef PAGEDLLM_WORK_ITEMS_H
#define PAGEDLLM_WORK_ITEMS_H

#include <stdint.h>

#define INLINE static inline __attribute__((always_inline))

/* Rows of W per work item of a product: about 8 items per thread, handed out as threads ask, so that a
   thread the OS runs late (the cores are shared) leaves its items to the others instead of holding up all. */
INLINE int64_t row_chunk(const int64_t N, const int nthreads) {
    const int64_t want = (N + 8 * nthreads - 1) / (8 * nthreads);
    return want < 16 ? 16 : (want + 7) / 8 * 8;
}

#endif
