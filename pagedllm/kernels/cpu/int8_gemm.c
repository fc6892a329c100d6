/* The exact int32 product of int8 rows and an int8 weight on the CPU (AVX2, OpenMP): y [M, N] = x [M, K] @ w [N, K]^T,
   the products of W8A8 linears, which torch's CPU int8 product answers slowly.

   Sixteen weights widen to 16-bit lanes and meet x's (widened once per call) in one multiply-add of pairs into
   32-bit lanes: every product and sum is exact (|q| <= 128: a pair sums to at most 2^15, a row of K to at most
   K * 2^14), so the result equals torch._int_mm's bit for bit whatever the order. */
#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "work_items.h"

INLINE int32_t hsum_epi32(const __m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

/* y[m, n] for MT rows of x16 (x widened) and weight rows [n0, n1). */
INLINE void mm_tile(const int MT, const int16_t *x16, const int64_t K, const int8_t *w, const int64_t n0,
                    const int64_t n1, int32_t *y, const int64_t N) {
    const int64_t body = K / 16 * 16;
    for (int64_t n = n0; n < n1; n++) {
        const int8_t *row = w + n * K;
        __m256i acc[4];
#pragma GCC unroll 4
        for (int m = 0; m < MT; m++) acc[m] = _mm256_setzero_si256();
        for (int64_t k = 0; k < body; k += 16) {
            const __m256i wv = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(row + k)));
#pragma GCC unroll 4
            for (int m = 0; m < MT; m++)
                acc[m] = _mm256_add_epi32(acc[m], _mm256_madd_epi16(wv, _mm256_loadu_si256((const __m256i *)(x16 + m * K + k))));
        }
#pragma GCC unroll 4
        for (int m = 0; m < MT; m++) {
            int32_t sum = hsum_epi32(acc[m]);
            for (int64_t k = body; k < K; k++) sum += (int32_t)row[k] * x16[m * K + k];
            y[m * N + n] = sum;
        }
    }
}

/* Returns 0, or -2 when the widened copy of x cannot be allocated. */
int int8_mm_i32(const int8_t *x, int64_t M, int64_t K, const int8_t *w, int64_t N, int32_t *y, int nthreads) {
    int16_t *x16 = aligned_alloc(64, ((size_t)(M * K) * sizeof(int16_t) + 63) / 64 * 64);
    if (!x16) return -2;
    for (int64_t i = 0; i < M * K; i++) x16[i] = x[i];
    if (M * N * K < (1 << 18)) nthreads = 1;  // a second thread costs more than such a product
    const int64_t chunk = row_chunk(N, nthreads), items = (N + chunk - 1) / chunk;
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1)
    for (int64_t t = 0; t < items; t++) {
        const int64_t n0 = t * chunk, n1 = n0 + chunk < N ? n0 + chunk : N;
        int64_t m = 0;
        for (; M - m >= 4; m += 4) mm_tile(4, x16 + m * K, K, w, n0, n1, y + m * N, N);
        if (M - m >= 2) { mm_tile(2, x16 + m * K, K, w, n0, n1, y + m * N, N); m += 2; }
        if (M - m == 1) mm_tile(1, x16 + m * K, K, w, n0, n1, y + m * N, N);
    }
    free(x16);
    return 0;
}

/* Each row of x [M, K] quantized symmetrically as int8_quant.quantize_int8_rows does: scale = max |x| / 127.5 (FLT_EPSILON
   for a row of zeros), q = x / scale clamped to [-128, 127] and rounded half to even (the default rounding mode);
   IEEE division in both places, as torch divides on the CPU. */
void quantize_rows_sym(const float *x, int64_t M, int64_t K, int8_t *q, float *scale) {
    for (int64_t m = 0; m < M; m++) {
        const float *row = x + m * K;
        float amax = 0.0f;
        for (int64_t k = 0; k < K; k++) amax = fmaxf(amax, fabsf(row[k]));
        float s = amax / 127.5f;
        if (s == 0.0f) s = FLT_EPSILON;
        scale[m] = s;
        for (int64_t k = 0; k < K; k++) q[m * K + k] = (int8_t)nearbyintf(fminf(fmaxf(row[k] / s, -128.0f), 127.0f));
    }
}

/* out [M, N] = (acc * xs[m]) * ws[n], rounded after each product as the torch epilogue rounds. */
void scale_rows(const int32_t *acc, int64_t M, int64_t N, const float *xs, const float *ws, float *out) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < N; n++) out[m * N + n] = ((float)acc[m * N + n] * xs[m]) * ws[n];
}
