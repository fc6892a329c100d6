/* Products of GGUF-quantized weights kept in their ggml blocks with the activations quantized to 8-bit blocks,
   the arithmetic llama.cpp uses on the CPU: integer dot products of the weights' integers with the activations'
   (AVX-512 VNNI or AVX-VNNI where the build enables them, else AVX2's byte multiply-adds), scaled per group.

   Each row of x is cut into groups of 32 elements, each stored as 32 signed bytes qx = round(x / dx) with
   dx = max |x| / 127 (float32), as llama.cpp's Q8_0 activations but with a float32 scale. For a weight group
   w_j = a * (q_j - o) - c (o: the type's integer offset, c: Q4_K / Q5_K's min):
       sum_j w_j x_j  ~  a * dx * sum_j (q_j - o) * qx_j  -  c * sum_j x_j
   The integer sum is exact; the offset enters it as a precomputed -o * (sum of qx over each 4 bytes), the
   dot product's starting value; the min term uses the exact float sum of x. Only x's rounding to 8 bits
   (a relative error of at most 1/254 of the group's largest element per element) and float32 rounding differ
   from x @ W.T. Q8_0's signed weights meet x through the sign trick: |q| times x with q's sign.

   The block layouts and how their integers are read: gguf_blocks.h.
*/
#include <math.h>
#include <stdlib.h>

#include "gguf_blocks.h"

/* acc + the sums of four adjacent products of unsigned bytes u and signed bytes s, per 32-bit lane. */
INLINE __m256i dot_u8i8(const __m256i acc, const __m256i u, const __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    // Each byte pair sums to at most 2 * 128 * 127 in magnitude: no saturation in 16 bits.
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

/* Quantized rows of x: qx [M, K] bytes, dx [M, K / 32] scales, sx [M, K / 32] exact sums of each group,
   negoff [M, K / 32, 8] the offset term per 32-bit lane of each group's dot product. */
typedef struct {
    int8_t *qx;
    float *dx, *sx;
    int32_t *negoff;
} QuantX;

INLINE float hmax8(const __m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

INLINE float hsum8(const __m256 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static void quantize_x(const int type, const float *x, const int64_t M, const int64_t K, const QuantX *q) {
    const int64_t groups = K / 32;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i offset = _mm256_set1_epi16((short)-q_offset(type));
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < groups; g++) {
            const float *src = x + m * K + 32 * g;
            __m256 v[4], amax = _mm256_setzero_ps();
            for (int i = 0; i < 4; i++) {
                v[i] = _mm256_loadu_ps(src + 8 * i);
                amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
            }
            const float d = hmax8(amax) / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
            __m256i iv[4];
            for (int i = 0; i < 4; i++)
                iv[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], _mm256_set1_ps(inv)),
                                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            // Packing works within 128-bit halves; the permute puts the 32 bytes back in element order.
            const __m256i w16a = _mm256_packs_epi32(iv[0], iv[1]), w16b = _mm256_packs_epi32(iv[2], iv[3]);
            const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w16a, w16b),
                                                              _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256((__m256i *)(q->qx + m * K + 32 * g), bytes);
            q->dx[m * groups + g] = d;
            q->sx[m * groups + g] = hsum8(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
            // -o * (sum of each 4 bytes): pairs of bytes times -o, then pairs of 16-bit sums.
            const __m256i pairs = _mm256_maddubs_epi16(_mm256_set1_epi8(1), bytes);
            _mm256_storeu_si256((__m256i *)(q->negoff + (m * groups + g) * 8), _mm256_madd_epi16(pairs, offset));
        }
}

/* One block of a 32-element type against MT rows of quantized x: acc[m] += a * dx * (q - o) . qx. */
INLINE void q8_block32(const int type, const int MT, const QuantX *q, const int64_t K, const int64_t nblocks,
                       const uint8_t *blk, const int64_t b, __m256 acc[4]) {
    const __m256i qw = group_ints(type, blk, 0);
    const __m256i u = type == Q8_0 ? _mm256_sign_epi8(qw, qw) : qw;
    const float a = half_at(blk);
#pragma GCC unroll 4
    for (int m = 0; m < MT; m++) {
        const int64_t G = m * nblocks + b;
        __m256i s = _mm256_loadu_si256((const __m256i *)(q->qx + m * K + 32 * b));
        if (type == Q8_0) s = _mm256_sign_epi8(s, qw);
        const __m256i start = q_offset(type) ? _mm256_loadu_si256((const __m256i *)(q->negoff + G * 8))
                                             : _mm256_setzero_si256();
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8i8(start, u, s)), _mm256_set1_ps(a * q->dx[G]), acc[m]);
    }
}

/* Weight rows [n0, n1) of a 32-element block type against MT rows of quantized x; even and odd blocks
   accumulate apart (two short dependency chains). */
INLINE void q8_tile32(const int type, const int MT, const QuantX *q, const int64_t K, const uint8_t *w,
                      const int64_t row_bytes, const int64_t n0, const int64_t n1, float *y, const int64_t N) {
    const int64_t nblocks = K / 32;
    const int bb = block_bytes(type);
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = w + n * row_bytes;
        __m256 even[4], odd[4];
#pragma GCC unroll 4
        for (int m = 0; m < MT; m++) even[m] = odd[m] = _mm256_setzero_ps();
        int64_t b = 0;
        for (; b + 2 <= nblocks; b += 2) {
            q8_block32(type, MT, q, K, nblocks, row + b * bb, b, even);
            q8_block32(type, MT, q, K, nblocks, row + (b + 1) * bb, b + 1, odd);
        }
        if (b < nblocks) q8_block32(type, MT, q, K, nblocks, row + b * bb, b, even);
#pragma GCC unroll 4
        for (int m = 0; m < MT; m++) y[m * N + n] = hsum8(_mm256_add_ps(even[m], odd[m]));
    }
}

/* The same for the 256-element K-quants: per group its own scale (Q6_K: one per 16 elements, per half of the
   dot product's lanes); Q4_K / Q5_K's min term from the exact sums of x, eight groups at once. */
INLINE void q8_tileK(const int type, const int MT, const QuantX *q, const int64_t K, const uint8_t *w,
                     const int64_t row_bytes, const int64_t n0, const int64_t n1, float *y, const int64_t N) {
    const int64_t nblocks = K / 256, groups = K / 32;
    const int bb = block_bytes(type);
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = w + n * row_bytes;
        __m256 acc[4][2], mins[4];
#pragma GCC unroll 4
        for (int m = 0; m < MT; m++) acc[m][0] = acc[m][1] = mins[m] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nblocks; b++) {
            const uint8_t *blk = row + b * bb;
            Scales s;
            block_scales(type, blk, &s);
#pragma GCC unroll 8
            for (int g = 0; g < 8; g++) {
                const __m256i u = group_ints(type, blk, g);
                const __m256 a = group_vec(type, s.a, g);
#pragma GCC unroll 4
                for (int m = 0; m < MT; m++) {
                    const int64_t G = m * groups + 8 * b + g;
                    const __m256i sx = _mm256_loadu_si256((const __m256i *)(q->qx + m * K + 256 * b + 32 * g));
                    const __m256i start = q_offset(type) ? _mm256_loadu_si256((const __m256i *)(q->negoff + G * 8))
                                                         : _mm256_setzero_si256();
                    const __m256 scale = _mm256_mul_ps(a, _mm256_set1_ps(q->dx[G]));
                    acc[m][g & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8i8(start, u, sx)), scale, acc[m][g & 1]);
                }
            }
            if (has_min(type)) {
                const __m256 c = _mm256_load_ps(s.c);
#pragma GCC unroll 4
                for (int m = 0; m < MT; m++)
                    mins[m] = _mm256_fnmadd_ps(c, _mm256_loadu_ps(q->sx + m * groups + 8 * b), mins[m]);
            }
        }
#pragma GCC unroll 4
        for (int m = 0; m < MT; m++) y[m * N + n] = hsum8(_mm256_add_ps(_mm256_add_ps(acc[m][0], acc[m][1]), mins[m]));
    }
}

INLINE void q8_span(const int type, const QuantX *q, const int64_t M, const int64_t K, const uint8_t *w,
                    const int64_t row_bytes, const int64_t n0, const int64_t n1, float *y, const int64_t N) {
    // Tiles of up to 4 rows of x: each weight group is read from memory once per tile.
    for (int64_t m = 0; m < M;) {
        const int64_t rest = M - m;
        const QuantX sub = {q->qx + m * K, q->dx + m * (K / 32), q->sx + m * (K / 32), q->negoff + m * (K / 32) * 8};
        float *ym = y + m * N;
#define Q8_TILE(MT)                                                                                    \
        if (block_elems(type) == 32) q8_tile32(type, MT, &sub, K, w, row_bytes, n0, n1, ym, N);        \
        else q8_tileK(type, MT, &sub, K, w, row_bytes, n0, n1, ym, N);                                 \
        m += MT
        if (rest >= 4) { Q8_TILE(4); }
        else if (rest == 3) { Q8_TILE(3); }
        else if (rest == 2) { Q8_TILE(2); }
        else { Q8_TILE(1); }
#undef Q8_TILE
    }
}

/* One entry point per type, so that each inlined kernel is specialised on its constant type. */
#define DEFINE_Q8(T)                                                                                       \
    static void q8_##T(const QuantX *q, int64_t M, int64_t K, const uint8_t *w, int64_t row_bytes, int64_t N,  \
                       float *y, int nthreads) {                                                           \
        const int64_t chunk = row_chunk(N, nthreads), chunks = (N + chunk - 1) / chunk;                     \
        _Pragma("omp parallel for num_threads(nthreads) schedule(dynamic, 1)")                              \
        for (int64_t c = 0; c < chunks; c++)                                                                \
            q8_span(T, q, M, K, w, row_bytes, c * chunk, c * chunk + chunk < N ? c * chunk + chunk : N, y, N); \
    }

DEFINE_Q8(Q4_0)
DEFINE_Q8(Q5_0)
DEFINE_Q8(Q8_0)
DEFINE_Q8(Q4_K)
DEFINE_Q8(Q5_K)
DEFINE_Q8(Q6_K)

enum { SERIAL_MACS = 1 << 18 };

/* y [M, N] ~ x [M, K] @ W.T for W [N, row_bytes] of `type` blocks, x quantized to 8-bit groups of 32. Returns
   0, -1 for an unknown type, -2 when the quantized copy of x cannot be allocated. */
int gguf_mm_q8(int type, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t row_bytes, int64_t N,
               float *y, int nthreads) {
    // Below ~20 us of work two threads are no faster than one, and one never waits for a late second.
    if (M * N * K < SERIAL_MACS) nthreads = 1;
    const int64_t groups = M * (K / 32);
    char *mem = aligned_alloc(64, ((size_t)(M * K + groups * 2 * sizeof(float) + groups * 8 * sizeof(int32_t)) + 63) / 64 * 64);
    if (!mem) return -2;
    // negoff first: its 32-byte lanes stay aligned; then the scales and sums, then the bytes.
    const QuantX q = {(int8_t *)(mem + groups * (8 * sizeof(int32_t) + 2 * sizeof(float))),
                      (float *)(mem + groups * 8 * sizeof(int32_t)),
                      (float *)(mem + groups * (8 * sizeof(int32_t) + sizeof(float))), (int32_t *)mem};
    quantize_x(type, x, M, K, &q);
    int status = 0;
    switch (type) {
    case Q4_0: q8_Q4_0(&q, M, K, w, row_bytes, N, y, nthreads); break;
    case Q5_0: q8_Q5_0(&q, M, K, w, row_bytes, N, y, nthreads); break;
    case Q8_0: q8_Q8_0(&q, M, K, w, row_bytes, N, y, nthreads); break;
    case Q4_K: q8_Q4_K(&q, M, K, w, row_bytes, N, y, nthreads); break;
    case Q5_K: q8_Q5_K(&q, M, K, w, row_bytes, N, y, nthreads); break;
    case Q6_K: q8_Q6_K(&q, M, K, w, row_bytes, N, y, nthreads); break;
    default: status = -1;
    }
    free(mem);
    return status;
}
