/* Paged decode attention over float32 rows, for the CPU decode step: one query token per request.

   As torch ops a layer's decode is ~15 calls (gather of the keys, the scaled and masked product, softmax,
   the weighted value sum), each of which costs more than its arithmetic at one or a few requests. Here a
   layer is one call that reads keys and values in place in the cache.

   For request b, query head h (KV head h / G) and its visible keys j < count[b] at cache slots slots[b, j]:
     s_j = scale * (q . k_j), soft-capped to cap * tanh(s_j / cap) when cap > 0;
     p_j = exp(s_j - max_j s_j) / sum_j exp(s_j - max_j s_j);   out = sum_j p_j v_j.
   The keys of slots past count[b] are not read (their torch-path probability is exactly 0). Results differ
   from the torch path only by float32 rounding (summation order, exp).
*/
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>


/* Work items (request, KV head) at and above this count are split between threads. */
#define PARALLEL_ITEMS 2

/* Keys ahead of the one being scored whose rows are requested from memory. */
#define PREFETCH_AHEAD 4

static inline void prefetch_row(const float *p, const int64_t d) {
    for (int64_t i = 0; i < d; i += 16) _mm_prefetch((const char *)(p + i), _MM_HINT_T0);
}

static inline float hsum(const __m256 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* out[h] = q_h . k for NH <= 4 query heads at once: 2 * NH independent accumulator chains. */
static inline void dots(const int NH, const float *q, const float *k, const int64_t d, float *out) {
    __m256 acc[4][2];
    for (int h = 0; h < NH; h++) acc[h][0] = acc[h][1] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= d; i += 16) {
        const __m256 k0 = _mm256_loadu_ps(k + i), k1 = _mm256_loadu_ps(k + i + 8);
        for (int h = 0; h < NH; h++) {
            acc[h][0] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * d + i), k0, acc[h][0]);
            acc[h][1] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * d + i + 8), k1, acc[h][1]);
        }
    }
    for (; i + 8 <= d; i += 8) {
        const __m256 k0 = _mm256_loadu_ps(k + i);
        for (int h = 0; h < NH; h++) acc[h][0] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * d + i), k0, acc[h][0]);
    }
    for (int h = 0; h < NH; h++) {
        float total = hsum(_mm256_add_ps(acc[h][0], acc[h][1]));
        for (int64_t t = i; t < d; t++) total += q[h * d + t] * k[t];
        out[h] = total;
    }
}

/* out[h, i0 .. i0 + 32) = sum_j p[h, j] v_j[i0 ..] for NH <= 4 heads: each value chunk loaded once for all
   heads, the sums kept in registers across the keys. */
static inline void weighted_values(const int NH, const float *p, const int64_t count, const float *v_cache,
                                   const int64_t *slots, const int64_t row, const int64_t off, const int64_t i0,
                                   const int64_t d, float *out) {
    __m256 acc[4][4];
    for (int h = 0; h < NH; h++)
        for (int x = 0; x < 4; x++) acc[h][x] = _mm256_setzero_ps();
    for (int64_t j = 0; j < count; j++) {
        const float *v = v_cache + slots[j] * row + off + i0;
        const __m256 v0 = _mm256_loadu_ps(v), v1 = _mm256_loadu_ps(v + 8);
        const __m256 v2 = _mm256_loadu_ps(v + 16), v3 = _mm256_loadu_ps(v + 24);
        for (int h = 0; h < NH; h++) {
            const __m256 ph = _mm256_broadcast_ss(p + h * count + j);
            acc[h][0] = _mm256_fmadd_ps(ph, v0, acc[h][0]);
            acc[h][1] = _mm256_fmadd_ps(ph, v1, acc[h][1]);
            acc[h][2] = _mm256_fmadd_ps(ph, v2, acc[h][2]);
            acc[h][3] = _mm256_fmadd_ps(ph, v3, acc[h][3]);
        }
    }
    for (int h = 0; h < NH; h++)
        for (int x = 0; x < 4; x++) _mm256_storeu_ps(out + h * d + i0 + 8 * x, acc[h][x]);
}

/* One request and KV head: its G query heads against the same keys, scores in `scores` [G, S]. */
static void attend(const float *q, const float *k_cache, const float *v_cache, const int64_t *slots,
                   const int64_t count, const int64_t hkv, const int64_t kv_head, const int64_t g,
                   const int64_t d, const float scale, const float cap, float *scores, float *out) {
    const int64_t row = hkv * d, off = kv_head * d;  /* floats per cache slot; this head's offset in it */
    for (int64_t j = 0; j < count; j++) {
        const float *k = k_cache + slots[j] * row + off;
        // The rows sit wherever the block table put them, out of the hardware prefetcher's sight, and the
        // weights streamed since the last step evicted them: ask for key j + PREFETCH_AHEAD and value j now.
        if (j + PREFETCH_AHEAD < count) prefetch_row(k_cache + slots[j + PREFETCH_AHEAD] * row + off, d);
        prefetch_row(v_cache + slots[j] * row + off, d);
        for (int64_t h0 = 0; h0 < g; h0 += 4) {
            const int nh = g - h0 < 4 ? (int)(g - h0) : 4;
            float s[4];
            dots(nh, q + h0 * d, k, d, s);
            for (int h = 0; h < nh; h++) {
                float x = scale * s[h];
                if (cap > 0.0f) x = cap * tanhf(x / cap);
                scores[(h0 + h) * count + j] = x;
            }
        }
    }
    for (int64_t h = 0; h < g; h++) {
        float *sc = scores + h * count, top = -INFINITY, total = 0.0f;
        for (int64_t j = 0; j < count; j++) top = sc[j] > top ? sc[j] : top;
        for (int64_t j = 0; j < count; j++) {
            sc[j] = expf(sc[j] - top);
            total += sc[j];
        }
        const float inv = 1.0f / total;
        for (int64_t j = 0; j < count; j++) sc[j] *= inv;
    }
    const int64_t body = d / 32 * 32;
    for (int64_t h0 = 0; h0 < g; h0 += 4) {
        const int nh = g - h0 < 4 ? (int)(g - h0) : 4;
        for (int64_t i0 = 0; i0 < body; i0 += 32)
            weighted_values(nh, scores + h0 * count, count, v_cache, slots, row, off, i0, d, out + h0 * d);
    }
    for (int64_t h = 0; h < g; h++)  /* the last d % 32 channels */
        for (int64_t i = body; i < d; i++) {
            float total = 0.0f;
            for (int64_t j = 0; j < count; j++) total += scores[h * count + j] * v_cache[slots[j] * row + off + i];
            out[h * d + i] = total;
        }
}

/* query [B, Hq, D], out [B, Hq, D]; caches [num_slots, Hkv, D]; slots [B, S] int64, counts [B] int64 (1..S).
   Returns 0; -1 when the scores cannot be allocated; -2 - r when request r's count or one of its visible
   slots is out of range (nothing is read then). */
int64_t decode_attention_f32(const float *query, const float *k_cache, const float *v_cache, const int64_t *slots,
                             const int64_t *counts, const int64_t b, const int64_t s, const int64_t hq,
                             const int64_t hkv, const int64_t d, const int64_t num_slots, const float scale,
                             const float cap, float *out, int nthreads) {
    for (int64_t r = 0; r < b; r++) {
        if (counts[r] < 1 || counts[r] > s) return -2 - r;
        for (int64_t j = 0; j < counts[r]; j++)
            if (slots[r * s + j] < 0 || slots[r * s + j] >= num_slots) return -2 - r;
    }
    const int64_t g = hq / hkv, items = b * hkv;
    if (items < PARALLEL_ITEMS || nthreads < 1) nthreads = 1;
    if (nthreads > items) nthreads = (int)items;
    const int64_t per_thread = g * s > 0 ? g * s : 1;
    float *scores = malloc((size_t)(per_thread * nthreads) * sizeof(float));
    if (!scores) return -1;
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1)
    for (int64_t it = 0; it < items; it++) {
        const int64_t r = it / hkv, h = it % hkv;
        attend(query + (r * hq + h * g) * d, k_cache, v_cache, slots + r * s, counts[r], hkv, h, g, d, scale, cap,
               scores + per_thread * omp_get_thread_num(), out + (r * hq + h * g) * d);
    }
    free(scores);
    return 0;
}

/* The cache rows of this step's keys and values: slot slots[t] of k_cache / v_cache [num_slots, Hkv, D]
   gets token t's [Hkv, D] from key / value (token stride ts, head stride hs, channels contiguous);
   negative slots (padding) are skipped. Returns 0, or 1 + t for the first slot at or past num_slots. */
int64_t write_kv_f32(const float *key, const float *value, const int64_t ts, const int64_t hs, const int64_t t,
                     const int64_t hkv, const int64_t d, const int64_t *slots, const int64_t num_slots,
                     float *k_cache, float *v_cache) {
    for (int64_t i = 0; i < t; i++)
        if (slots[i] >= num_slots) return 1 + i;
    for (int64_t i = 0; i < t; i++) {
        if (slots[i] < 0) continue;
        for (int64_t h = 0; h < hkv; h++) {
            memcpy(k_cache + (slots[i] * hkv + h) * d, key + i * ts + h * hs, (size_t)d * sizeof(float));
            memcpy(v_cache + (slots[i] * hkv + h) * d, value + i * ts + h * hs, (size_t)d * sizeof(float));
        }
    }
    return 0;
}
