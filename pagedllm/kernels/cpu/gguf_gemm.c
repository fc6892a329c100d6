/* Products and row decodes of GGUF-quantized weights kept in their packed ggml blocks (AVX2 + FMA + F16C; with
   AVX-512 where the build enables it, for the one- and two-row products of the 32-element block types).

   A weight row is a run of blocks; each block is read as groups of 32 consecutive elements. Every weight
   is w = a * q - c for a small integer q read from the bits, a scale a and an offset c: the products the
   format defines (f16 scale times integer scale, times q) are exact in float32, so a fused multiply-
   subtract rounds exactly where gguf-py's dequantize does, and decoded weights equal its output bit for
   bit. Products read the blocks directly: for one or two rows of x, q is multiplied into x and each
   group's sum scaled once (sum_j w_j x_j = a * sum_j q_j x_j - c * sum_j x_j); for more rows, each group is
   decoded once into weights shared by all rows. Only float32 rounding differs from x @ W.T.

   The block layouts and how their integers are read: gguf_blocks.h.
*/
#include <stdlib.h>

#include "gguf_blocks.h"

/* 32 bytes -> four vectors of floats in element order (dequantize's order). */
INLINE void bytes_to_floats(const __m256i b, __m256 v[4]) {
    const __m128i lo = _mm256_castsi256_si128(b), hi = _mm256_extracti128_si256(b, 1);
    v[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
    v[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(lo, lo)));
    v[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
    v[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(hi, hi)));
}

/* 32 bytes -> four vectors, v[k] holding elements 4i + k (i = 0..7): shifts within 32-bit lanes instead of
   cross-lane shuffles; products pair them with x in the same order (permute_x). Q8_0's bytes are signed. */
INLINE void bytes_to_floats_strided(const int type, const __m256i b, __m256 v[4]) {
    if (type == Q8_0) {
        v[0] = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(b, 24), 24));
        v[1] = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(b, 16), 24));
        v[2] = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(b, 8), 24));
        v[3] = _mm256_cvtepi32_ps(_mm256_srai_epi32(b, 24));
    } else {
        const __m256i byte = _mm256_set1_epi32(0xFF);
        v[0] = _mm256_cvtepi32_ps(_mm256_and_si256(b, byte));
        v[1] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(b, 8), byte));
        v[2] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(b, 16), byte));
        v[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 24));
    }
}

/* Group g as gguf-py dequantizes it, in element order. The offset is subtracted from the integers, as
   gguf-py does, so that a zero weight keeps the sign of its scale (a * q - a * offset would be +0). */
INLINE void decode_group(const int type, const uint8_t *blk, const Scales *s, const int g, __m256 v[4]) {
    bytes_to_floats(_mm256_sub_epi8(group_ints(type, blk, g), _mm256_set1_epi8((char)q_offset(type))), v);
    const __m256 a = group_vec(type, s->a, g), c = group_vec(type, s->c, g);
    // Vectors 0-1 are elements 0-15 (the low half of a and c), vectors 2-3 elements 16-31 (the high half).
    const __m256 a_lo = _mm256_permute2f128_ps(a, a, 0x00), a_hi = _mm256_permute2f128_ps(a, a, 0x11);
    const __m256 c_lo = _mm256_permute2f128_ps(c, c, 0x00), c_hi = _mm256_permute2f128_ps(c, c, 0x11);
    if (has_min(type)) {
        v[0] = _mm256_fmsub_ps(a_lo, v[0], c_lo);
        v[1] = _mm256_fmsub_ps(a_lo, v[1], c_lo);
        v[2] = _mm256_fmsub_ps(a_hi, v[2], c_hi);
        v[3] = _mm256_fmsub_ps(a_hi, v[3], c_hi);
    } else {
        v[0] = _mm256_mul_ps(a_lo, v[0]);
        v[1] = _mm256_mul_ps(a_lo, v[1]);
        v[2] = _mm256_mul_ps(a_hi, v[2]);
        v[3] = _mm256_mul_ps(a_hi, v[3]);
    }
}

INLINE float hsum(const __m256 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* y[m, n] for MT rows of x and weight rows [n0, n1), each group decoded once for all MT rows in the strided
   order of bytes_to_floats_strided, x permuted to match (xp). Factored (MT <= 2): the integers meet x and
   a group's sum is scaled once, its offset term taken from xs (per row of x and group: eight floats that
   sum to the group's x; negated offset times that for Q4_0 / Q5_0 / Q6_K). Otherwise the group is scaled
   into weights once, then one FMA per vector and row. */
INLINE void mm_tile(const int type, const int MT, const float *xp, const float *xs, const int64_t K,
                    const uint8_t *w, const int64_t row_bytes, const int64_t n0, const int64_t n1, float *y,
                    const int64_t N, const int64_t b0, const int64_t b1, const int add) {
    const int factored = MT <= 2;
    // The min term's own accumulator shortens the dependency chain when there are few.
    const int nacc = factored && has_min(type) ? 2 : 1;
    const int groups = block_elems(type) / 32, bb = block_bytes(type);
    const int64_t xs_stride = K / 4;
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = w + n * row_bytes;
        __m256 acc[8][2];
#pragma GCC unroll 8
        for (int m = 0; m < MT; m++) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
        for (int64_t b = b0; b < b1; b++) {
            const uint8_t *blk = row + b * bb;
            Scales s;
            block_scales(type, blk, &s);
#pragma GCC unroll 8
            for (int g = 0; g < groups; g++) {
                __m256 v[4];
                bytes_to_floats_strided(type, group_ints(type, blk, g), v);
                const __m256 a = group_vec(type, s.a, g);
                const int64_t k0 = b * block_elems(type) + 32 * g;
                if (factored) {
#pragma GCC unroll 2
                    for (int m = 0; m < MT; m++) {
                        const float *xk = xp + m * K + k0, *xsum = xs + m * xs_stride + k0 / 4;
                        __m256 t = q_offset(type) ? _mm256_fmadd_ps(v[0], _mm256_loadu_ps(xk), _mm256_loadu_ps(xsum))
                                                  : _mm256_mul_ps(v[0], _mm256_loadu_ps(xk));
                        t = _mm256_fmadd_ps(v[1], _mm256_loadu_ps(xk + 8), t);
                        t = _mm256_fmadd_ps(v[2], _mm256_loadu_ps(xk + 16), t);
                        t = _mm256_fmadd_ps(v[3], _mm256_loadu_ps(xk + 24), t);
                        acc[m][0] = _mm256_fmadd_ps(a, t, acc[m][0]);
                        if (has_min(type))
                            acc[m][nacc - 1] = _mm256_fnmadd_ps(_mm256_broadcast_ss(&s.c[g]), _mm256_loadu_ps(xsum),
                                                                acc[m][nacc - 1]);
                    }
                } else {
                    const __m256 c = group_vec(type, s.c, g);
#pragma GCC unroll 4
                    for (int i = 0; i < 4; i++)
                        v[i] = type == Q8_0 ? _mm256_mul_ps(a, v[i]) : _mm256_fmsub_ps(a, v[i], c);
#pragma GCC unroll 8
                    for (int m = 0; m < MT; m++) {
                        const float *xk = xp + m * K + k0;
#pragma GCC unroll 4
                        for (int i = 0; i < 4; i++) acc[m][0] = _mm256_fmadd_ps(v[i], _mm256_loadu_ps(xk + 8 * i), acc[m][0]);
                    }
                }
            }
        }
#pragma GCC unroll 8
        for (int m = 0; m < MT; m++) {
            const float sum = hsum(nacc == 2 ? _mm256_add_ps(acc[m][0], acc[m][1]) : acc[m][0]);
            y[m * N + n] = add ? y[m * N + n] + sum : sum;
        }
    }
}

/* Elements of K per span of a product with several rows of x: 8 rows of x and their sums, 20 KiB. */
enum { KSPAN = 512 };

INLINE void mm_rows(const int type, const float *xp, const float *xs, const int64_t M, const int64_t K,
                    const uint8_t *w, const int64_t row_bytes, const int64_t n0, const int64_t n1, float *y,
                    const int64_t N) {
    // With 8 rows of x or more and a long K, K is walked in spans whose slice of x stays in the L1 cache
    // while it meets every weight row of [n0, n1); the partial sums add up in y. (Measured on Zen 3: K = 2048
    // at 8 and 16 rows took 10-25% less time; K <= 1024, or fewer rows, took more.)
    const int64_t nblocks = K / block_elems(type);
    const int64_t span = M >= 8 && K >= 4 * KSPAN ? KSPAN / block_elems(type) : nblocks;
    for (int64_t b0 = 0; b0 < nblocks; b0 += span) {
        const int64_t b1 = b0 + span < nblocks ? b0 + span : nblocks;
        int64_t m = 0;
#define TILE(MT)                                                                                         \
        mm_tile(type, MT, xp + m * K, xs + m * (K / 4), K, w, row_bytes, n0, n1, y + m * N, N, b0, b1, b0 > 0); \
        m += MT
        while (M - m >= 8) { TILE(8); }
        const int64_t rest = M - m;
        if (rest >= 4) { TILE(4); }
        if (rest & 2) { TILE(2); }
        if (rest & 1) { TILE(1); }
#undef TILE
    }
}

/* xp [M, K]: x with each group of 32 reordered for bytes_to_floats_strided (position 8k + i holds element
   4i + k); xs [M, K / 4]: per group, the lane-wise sum of its four vectors, times -offset where the type
   has one (its term of the factored product). */
static void permute_x(const int type, const float *x, const int64_t M, const int64_t K, float *xp, float *xs) {
    const float factor = q_offset(type) ? -(float)q_offset(type) : 1.0f;
    for (int64_t m = 0; m < M; m++)
        for (int64_t k0 = 0; k0 < K; k0 += 32) {
            const float *src = x + m * K + k0;
            float *dst = xp + m * K + k0, *sum = xs + m * (K / 4) + k0 / 4;
            for (int k = 0; k < 4; k++)
                for (int i = 0; i < 8; i++) dst[8 * k + i] = src[4 * i + k];
            for (int i = 0; i < 8; i++) sum[i] = factor * ((dst[i] + dst[8 + i]) + (dst[16 + i] + dst[24 + i]));
        }
}

INLINE void decode_row(const int type, const uint8_t *row, const int64_t K, float *out) {
    const int groups = block_elems(type) / 32, bb = block_bytes(type);
    const int64_t nblocks = K / block_elems(type);
    for (int64_t b = 0; b < nblocks; b++) {
        Scales s;
        block_scales(type, row + b * bb, &s);
#pragma GCC unroll 8
        for (int g = 0; g < groups; g++) {
            __m256 v[4];
            decode_group(type, row + b * bb, &s, g, v);
            float *o = out + b * block_elems(type) + 32 * g;
            for (int i = 0; i < 4; i++) _mm256_storeu_ps(o + 8 * i, v[i]);
        }
    }
}

/* One entry point per type, so that each inlined kernel is specialised on its constant type (the type
   must be a literal inside the parallel region, which the compiler outlines before inlining). */
#define DEFINE_TYPE(T)                                                                                     \
    static void mm_##T(const float *xp, const float *xs, int64_t M, int64_t K, const uint8_t *w,          \
                       int64_t row_bytes, int64_t N, float *y, int nthreads) {                             \
        const int64_t chunk = row_chunk(N, nthreads), chunks = (N + chunk - 1) / chunk;                     \
        _Pragma("omp parallel for num_threads(nthreads) schedule(dynamic, 1)")                              \
        for (int64_t c = 0; c < chunks; c++)                                                                \
            mm_rows(T, xp, xs, M, K, w, row_bytes, c * chunk, c * chunk + chunk < N ? c * chunk + chunk : N, y, N); \
    }                                                                                                       \
    static void rows_##T(const uint8_t *w, int64_t row_bytes, int64_t K, const int64_t *ids, int64_t rows, \
                         float *out, int nthreads) {                                                        \
        _Pragma("omp parallel for num_threads(nthreads) schedule(static)")                                  \
        for (int64_t t = 0; t < rows; t++) decode_row(T, w + (ids ? ids[t] : t) * row_bytes, K, out + t * K);   \
    }

DEFINE_TYPE(Q4_0)
DEFINE_TYPE(Q5_0)
DEFINE_TYPE(Q8_0)
DEFINE_TYPE(Q4_K)
DEFINE_TYPE(Q5_K)
DEFINE_TYPE(Q6_K)

#ifdef __AVX512F__
/* The one- and two-row products of the 32-element block types with 16-float vectors, built where the CPU
   has AVX-512 (a decode step's products: the LM head, q/k/v, gate/up). x stays in element order; xs holds,
   per row of x and group, 16 floats whose sum is -offset * (the group's sum of x), the offset term of the
   factored product. A group's 32 integers become two vectors of 16 floats: elements 0-15 and 16-31. */
INLINE void group_ints16(const int type, const uint8_t *blk, __m512i q[2]) {
    if (type == Q8_0) {
        q[0] = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 2)));
        q[1] = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 18)));
        return;
    }
    const __m128i qs = _mm_loadu_si128((const __m128i *)(blk + (type == Q4_0 ? 2 : 6)));
    const __m128i nib = _mm_set1_epi8(0x0F);
    q[0] = _mm512_cvtepu8_epi32(_mm_and_si128(qs, nib));
    q[1] = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(qs, 4), nib));
    if (type == Q5_0) {
        uint32_t qh;
        memcpy(&qh, blk + 2, 4);
        const __m512i bit4 = _mm512_set1_epi32(16);
        q[0] = _mm512_mask_or_epi32(q[0], (__mmask16)(qh & 0xFFFF), q[0], bit4);
        q[1] = _mm512_mask_or_epi32(q[1], (__mmask16)(qh >> 16), q[1], bit4);
    }
}

/* One block of the factored product for MT rows of x: acc[m] += d * (q . x + offset term). */
INLINE void block16(const int type, const int MT, const uint8_t *blk, const float *x, const float *xs,
                    const int64_t K, const int64_t nblocks, const int64_t b, __m512 acc[2]) {
    __m512i q[2];
    group_ints16(type, blk, q);
    const __m512 v0 = _mm512_cvtepi32_ps(q[0]), v1 = _mm512_cvtepi32_ps(q[1]);
    const __m512 a = _mm512_set1_ps(half_at(blk));
#pragma GCC unroll 2
    for (int m = 0; m < MT; m++) {
        const float *xk = x + m * K + 32 * b;
        __m512 t = q_offset(type) ? _mm512_fmadd_ps(v0, _mm512_loadu_ps(xk), _mm512_loadu_ps(xs + (m * nblocks + b) * 16))
                                  : _mm512_mul_ps(v0, _mm512_loadu_ps(xk));
        t = _mm512_fmadd_ps(v1, _mm512_loadu_ps(xk + 16), t);
        acc[m] = _mm512_fmadd_ps(a, t, acc[m]);
    }
}

INLINE void mm_tile16(const int type, const int MT, const float *x, const float *xs, const int64_t K,
                      const uint8_t *w, const int64_t row_bytes, const int64_t n0, const int64_t n1, float *y,
                      const int64_t N) {
    const int64_t nblocks = K / 32;
    const int bb = block_bytes(type);
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = w + n * row_bytes;
        // Even and odd blocks in their own registers: two short dependency chains instead of one long one.
        __m512 even[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()}, odd[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
        int64_t b = 0;
        for (; b + 2 <= nblocks; b += 2) {
            block16(type, MT, row + b * bb, x, xs, K, nblocks, b, even);
            block16(type, MT, row + (b + 1) * bb, x, xs, K, nblocks, b + 1, odd);
        }
        if (b < nblocks) block16(type, MT, row + b * bb, x, xs, K, nblocks, b, even);
#pragma GCC unroll 2
        for (int m = 0; m < MT; m++) y[m * N + n] = _mm512_reduce_add_ps(_mm512_add_ps(even[m], odd[m]));
    }
}

/* MT rows of x (3 to 8): each block decoded once into 32 weights, as gguf-py rounds them (the offset
   subtracted from the integers, then times d), then two FMAs per row of x. */
INLINE void mm_tile16_rows(const int type, const int MT, const float *x, const int64_t K, const uint8_t *w,
                           const int64_t row_bytes, const int64_t n0, const int64_t n1, float *y, const int64_t N) {
    const int64_t nblocks = K / 32;
    const int bb = block_bytes(type);
    const __m512i off = _mm512_set1_epi32(q_offset(type));
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = w + n * row_bytes;
        __m512 acc[8][2];
#pragma GCC unroll 8
        for (int m = 0; m < MT; m++) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
        for (int64_t b = 0; b < nblocks; b++) {
            const uint8_t *blk = row + b * bb;
            __m512i q[2];
            group_ints16(type, blk, q);
            const __m512 a = _mm512_set1_ps(half_at(blk));
            const __m512 w0 = _mm512_mul_ps(a, _mm512_cvtepi32_ps(_mm512_sub_epi32(q[0], off)));
            const __m512 w1 = _mm512_mul_ps(a, _mm512_cvtepi32_ps(_mm512_sub_epi32(q[1], off)));
#pragma GCC unroll 8
            for (int m = 0; m < MT; m++) {
                const float *xk = x + m * K + 32 * b;
                acc[m][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xk), acc[m][0]);
                acc[m][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xk + 16), acc[m][1]);
            }
        }
#pragma GCC unroll 8
        for (int m = 0; m < MT; m++) y[m * N + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]));
    }
}

INLINE void mm16_span(const int type, const float *x, const float *xs, const int64_t M, const int64_t K,
                      const uint8_t *w, const int64_t row_bytes, const int64_t n0, const int64_t n1, float *y,
                      const int64_t N) {
    if (M == 2) { mm_tile16(type, 2, x, xs, K, w, row_bytes, n0, n1, y, N); return; }
    if (M == 1) { mm_tile16(type, 1, x, xs, K, w, row_bytes, n0, n1, y, N); return; }
    int64_t m = 0;
#define TILE16(MT) mm_tile16_rows(type, MT, x + m * K, K, w, row_bytes, n0, n1, y + m * N, N); m += MT
    while (M - m >= 8) { TILE16(8); }
    const int64_t rest = M - m;
    if (rest >= 4) { TILE16(4); }
    if (rest - (rest >= 4 ? 4 : 0) >= 2) { TILE16(2); }
    if (rest & 1) { TILE16(1); }
#undef TILE16
}

#define DEFINE_TYPE16(T)                                                                                   \
    static void mm16_##T(const float *x, const float *xs, int64_t M, int64_t K, const uint8_t *w,          \
                         int64_t row_bytes, int64_t N, float *y, int nthreads) {                           \
        const int64_t chunk = row_chunk(N, nthreads), chunks = (N + chunk - 1) / chunk;                     \
        _Pragma("omp parallel for num_threads(nthreads) schedule(dynamic, 1)")                              \
        for (int64_t c = 0; c < chunks; c++) {                                                              \
            const int64_t n0 = c * chunk, n1 = n0 + chunk < N ? n0 + chunk : N;                             \
            mm16_span(T, x, xs, M, K, w, row_bytes, n0, n1, y, N);                                          \
        }                                                                                                   \
    }

DEFINE_TYPE16(Q4_0)
DEFINE_TYPE16(Q5_0)
DEFINE_TYPE16(Q8_0)

/* 1 when the 16-float path took the product, 0 when it does not apply (or cannot allocate). */
static int mm16(int type, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t row_bytes, int64_t N,
                float *y, int nthreads) {
    if (type != Q4_0 && type != Q5_0 && type != Q8_0) return 0;
    const int64_t groups = K / 32;
    // The offset terms of the factored one- and two-row products (more rows take decoded weights).
    const int64_t xs_rows = M <= 2 ? M : 0;
    float *xs = aligned_alloc(64, ((size_t)(xs_rows * groups * 16 + 16) * sizeof(float) + 63) / 64 * 64);
    if (!xs) return 0;
    const float factor = -(float)q_offset(type);
    for (int64_t m = 0; m < xs_rows; m++)
        for (int64_t g = 0; g < groups; g++)
            for (int i = 0; i < 16; i++)
                xs[(m * groups + g) * 16 + i] = factor * (x[m * K + 32 * g + i] + x[m * K + 32 * g + 16 + i]);
    switch (type) {
    case Q4_0: mm16_Q4_0(x, xs, M, K, w, row_bytes, N, y, nthreads); break;
    case Q5_0: mm16_Q5_0(x, xs, M, K, w, row_bytes, N, y, nthreads); break;
    default: mm16_Q8_0(x, xs, M, K, w, row_bytes, N, y, nthreads); break;
    }
    free(xs);
    return 1;
}
#endif

enum { SERIAL_MACS = 1 << 18 };

/* y [M, N] = x [M, K] @ W.T for W [N, row_bytes] of `type` blocks. Returns 0, -1 for an unknown type, -2
   when the permuted copy of x cannot be allocated. */
int gguf_mm_f32(int type, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t row_bytes, int64_t N,
                float *y, int nthreads) {
    // Below ~20 us of work (the 640 x 256 products at one row) two threads measured no faster than one,
    // and one never waits for a second that the OS runs late.
    if (M * N * K < SERIAL_MACS) nthreads = 1;
#ifdef __AVX512F__
    if (mm16(type, x, M, K, w, row_bytes, N, y, nthreads)) return 0;
#endif
    float *xp = aligned_alloc(64, ((size_t)(M * K + M * (K / 4)) * sizeof(float) + 63) / 64 * 64);
    if (!xp) return -2;
    float *xs = xp + M * K;
    permute_x(type, x, M, K, xp, xs);
    int status = 0;
    switch (type) {
    case Q4_0: mm_Q4_0(xp, xs, M, K, w, row_bytes, N, y, nthreads); break;
    case Q5_0: mm_Q5_0(xp, xs, M, K, w, row_bytes, N, y, nthreads); break;
    case Q8_0: mm_Q8_0(xp, xs, M, K, w, row_bytes, N, y, nthreads); break;
    case Q4_K: mm_Q4_K(xp, xs, M, K, w, row_bytes, N, y, nthreads); break;
    case Q5_K: mm_Q5_K(xp, xs, M, K, w, row_bytes, N, y, nthreads); break;
    case Q6_K: mm_Q6_K(xp, xs, M, K, w, row_bytes, N, y, nthreads); break;
    default: status = -1;
    }
    free(xp);
    return status;
}

/* out [T, K] = rows ids[0..T) of W (rows 0..T) when ids is NULL) decoded. Returns 0, -1 for an unknown type,
   or 1 + t for the first ids[t] outside [0, N). */
int64_t gguf_dequant_rows(int type, const uint8_t *w, int64_t row_bytes, int64_t N, int64_t K, const int64_t *ids,
                          int64_t T, float *out, int nthreads) {
    if (ids)
        for (int64_t t = 0; t < T; t++)
            if (ids[t] < 0 || ids[t] >= N) return 1 + t;
    switch (type) {
    case Q4_0: rows_Q4_0(w, row_bytes, K, ids, T, out, nthreads); return 0;
    case Q5_0: rows_Q5_0(w, row_bytes, K, ids, T, out, nthreads); return 0;
    case Q8_0: rows_Q8_0(w, row_bytes, K, ids, T, out, nthreads); return 0;
    case Q4_K: rows_Q4_K(w, row_bytes, K, ids, T, out, nthreads); return 0;
    case Q5_K: rows_Q5_K(w, row_bytes, K, ids, T, out, nthreads); return 0;
    case Q6_K: rows_Q6_K(w, row_bytes, K, ids, T, out, nthreads); return 0;
    default: return -1;
    }
}
