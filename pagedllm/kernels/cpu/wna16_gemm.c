/* Products of 4/8-bit weight-only linears (AWQ, GPTQ, compressed-tensors W4A16 / W8A16) with the weight kept packed
   on the CPU (AVX2 + FMA, OpenMP): y = x @ W^T, W[n, k] = (q[n, k] - z[n, g]) * s[n, g], g = k / group.

   Each weight row is K / pack int32 words (pack = 32 / bits), value i of word j being input pack * j + i, in bits
   [i * bits, (i + 1) * bits). Eight words load as one vector, and value i of the eight becomes one vector of
   floats holding inputs pack * j + i (j = 0..7): shifts within 32-bit lanes, no shuffles. x is reordered to
   match once per call (permute_x). A weight is decoded as the torch path decodes it, (q - z), exact, then
   times s, one float32 rounding; so a decoded row equals the torch path's bit for bit, and a product differs
   from x @ dequantize(W).T only in the order of its float32 sums. Each output is summed by one thread in a
   fixed order, whatever the thread count.
*/
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "work_items.h"

/* The inputs a vector of eight words covers. */
INLINE int64_t chunk_elems(const int bits) { return 8 * (32 / bits); }

/* Scale and zero point of each of the eight words of chunk c (a word never straddles two groups). */
INLINE void chunk_params(const float *s, const float *z, const int64_t c, const int bits, const int64_t group,
                         __m256 *sv, __m256 *zv) {
    const int64_t pack = 32 / bits, k0 = c * chunk_elems(bits);
    if (group % chunk_elems(bits) == 0) {
        *sv = _mm256_set1_ps(s[k0 / group]);
        *zv = _mm256_set1_ps(z[k0 / group]);
        return;
    }
    float sl[8], zl[8];
    for (int j = 0; j < 8; j++) {
        sl[j] = s[(k0 + pack * j) / group];
        zl[j] = z[(k0 + pack * j) / group];
    }
    *sv = _mm256_loadu_ps(sl);
    *zv = _mm256_loadu_ps(zl);
}

/* Value i of eight words, decoded: (q - z) * s. */
INLINE __m256 decode(const __m256i words, const int i, const int bits, const __m256 sv, const __m256 zv) {
    const __m256i mask = _mm256_set1_epi32((1 << bits) - 1);
    const __m256 q = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(words, i * bits), mask));
    return _mm256_mul_ps(_mm256_sub_ps(q, zv), sv);
}

/* y[m, n] for MT rows of xp (reordered x) and weight rows [n0, n1). */
INLINE void mm_tile(const int MT, const int bits, const float *xp, const int64_t K, const int32_t *w,
                    const float *s, const float *z, const int64_t G, const int64_t group, const int64_t n0,
                    const int64_t n1, float *y, const int64_t N) {
    const int pack = 32 / bits;
    const int64_t chunks = K / chunk_elems(bits), words = K / pack;
    for (int64_t n = n0; n < n1; n++) {
        const int32_t *row = w + n * words;
        __m256 acc[4][2];
#pragma GCC unroll 4
        for (int m = 0; m < MT; m++) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
        for (int64_t c = 0; c < chunks; c++) {
            __m256 sv, zv;
            chunk_params(s + n * G, z + n * G, c, bits, group, &sv, &zv);
            const __m256i wv = _mm256_loadu_si256((const __m256i *)(row + 8 * c));
            const float *xc = xp + c * chunk_elems(bits);
#pragma GCC unroll 8
            for (int i = 0; i < pack; i++) {
                const __m256 wi = decode(wv, i, bits, sv, zv);
#pragma GCC unroll 4
                for (int m = 0; m < MT; m++)  // two accumulators a row: shorter chains of dependent FMAs
                    acc[m][i & 1] = _mm256_fmadd_ps(wi, _mm256_loadu_ps(xc + m * K + 8 * i), acc[m][i & 1]);
            }
        }
#pragma GCC unroll 4
        for (int m = 0; m < MT; m++) {
            const __m256 a = _mm256_add_ps(acc[m][0], acc[m][1]);
            __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
            h = _mm_add_ps(h, _mm_movehl_ps(h, h));
            h = _mm_add_ss(h, _mm_movehdup_ps(h));
            y[m * N + n] = _mm_cvtss_f32(h);
        }
    }
}

/* xp [M, K]: each chunk of x reordered so that position 8 i + j holds input pack * j + i. */
static void permute_x(const int bits, const float *x, const int64_t M, const int64_t K, float *xp) {
    const int64_t pack = 32 / bits, ce = chunk_elems(bits);
    for (int64_t m = 0; m < M; m++)
        for (int64_t k0 = 0; k0 < K; k0 += ce)
            for (int64_t i = 0; i < pack; i++)
                for (int64_t j = 0; j < 8; j++) xp[m * K + k0 + 8 * i + j] = x[m * K + k0 + pack * j + i];
}

#define DEFINE_BITS(B)                                                                                        \
    static void mm_##B(const float *xp, int64_t M, int64_t K, const int32_t *w, const float *s, const float *z, \
                       int64_t G, int64_t group, int64_t N, float *y, int nthreads) {                          \
        const int64_t chunk = row_chunk(N, nthreads), items = (N + chunk - 1) / chunk;                         \
        _Pragma("omp parallel for num_threads(nthreads) schedule(dynamic, 1)")                                 \
        for (int64_t t = 0; t < items; t++) {                                                                  \
            const int64_t n0 = t * chunk, n1 = n0 + chunk < N ? n0 + chunk : N;                                \
            int64_t m = 0;                                                                                     \
            for (; M - m >= 4; m += 4) mm_tile(4, B, xp + m * K, K, w, s, z, G, group, n0, n1, y + m * N, N); \
            if (M - m >= 2) { mm_tile(2, B, xp + m * K, K, w, s, z, G, group, n0, n1, y + m * N, N); m += 2; } \
            if (M - m == 1) mm_tile(1, B, xp + m * K, K, w, s, z, G, group, n0, n1, y + m * N, N);            \
        }                                                                                                      \
    }

DEFINE_BITS(4)
DEFINE_BITS(8)

enum { SERIAL_MACS = 1 << 18 };

/* y [M, N] = x [M, K] @ W^T for W given by qw [N, K / pack] int32, s and z [N, G] float32. Returns 0, -1 for
   unsupported bits or a K that is not a whole number of eight-word vectors, -2 when the reordered copy of x
   cannot be allocated. */
int wna16_mm_f32(const float *x, int64_t M, int64_t K, const int32_t *qw, const float *s, const float *z, int64_t G,
                 int64_t group, int bits, int64_t N, float *y, int nthreads) {
    if ((bits != 4 && bits != 8) || K % chunk_elems(bits) || group % (32 / bits)) return -1;
    if (M * N * K < SERIAL_MACS) nthreads = 1;  // a second thread costs more than such a product
    float *xp = aligned_alloc(64, ((size_t)(M * K) * sizeof(float) + 63) / 64 * 64);
    if (!xp) return -2;
    permute_x(bits, x, M, K, xp);
    if (bits == 4) mm_4(xp, M, K, qw, s, z, G, group, N, y, nthreads);
    else mm_8(xp, M, K, qw, s, z, G, group, N, y, nthreads);
    free(xp);
    return 0;
}

/* out [N, K] = W decoded, in input order. Returns 0, or -1 as wna16_mm_f32. */
int wna16_decode_f32(const int32_t *qw, const float *s, const float *z, int64_t G, int64_t group, int bits, int64_t N,
                     int64_t K, float *out, int nthreads) {
    if ((bits != 4 && bits != 8) || K % chunk_elems(bits) || group % (32 / bits)) return -1;
    const int64_t pack = 32 / bits, chunks = K / chunk_elems(bits);
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        for (int64_t c = 0; c < chunks; c++) {
            __m256 sv, zv;
            chunk_params(s + n * G, z + n * G, c, bits, group, &sv, &zv);
            const __m256i wv = _mm256_loadu_si256((const __m256i *)(qw + n * (K / pack) + 8 * c));
            float v[8];
            for (int i = 0; i < pack; i++) {
                _mm256_storeu_ps(v, decode(wv, i, bits, sv, zv));
                for (int j = 0; j < 8; j++) out[n * K + c * chunk_elems(bits) + pack * j + i] = v[j];
            }
        }
    }
    return 0;
}
