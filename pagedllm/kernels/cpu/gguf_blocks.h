/* GGUF (ggml) block layouts, read with AVX2: the scales of a block and the integers of each group of 32
   elements. Shared by the products that keep weights packed (gguf_gemm.c, float32 activations; gguf_q8_gemm.c,
   activations in 8-bit blocks).

   A weight row is a run of blocks; each block is read as groups of 32 consecutive elements. Every weight
   is w = a * q - c for a small integer q read from the bits, a scale a and an offset c.

   Block layouts (bytes) and the weight of element j of group g:
     Q4_0 (18):  f16 d, u8 qs[16]           q = qs[j] & 15 (j < 16), qs[j - 16] >> 4;    w = d * (q - 8)
     Q5_0 (22):  f16 d, u32 qh, u8 qs[16]   as Q4_0, plus bit j of qh as bit 4;          w = d * (q - 16)
     Q8_0 (34):  f16 d, i8 qs[32]                                                        w = d * qs[j]
     Q4_K (144): f16 d, f16 dmin, u8 scales[12] (eight 6-bit scales sc and mins m), u8 qs[128]:
                 q = nibble of qs[32 * (g / 2) + j], low for even g;                   w = d*sc[g] * q - dmin*m[g]
     Q5_K (176): as Q4_K with u8 qh[32] before qs, bit g of qh[j] as bit 4 of q
     Q6_K (210): u8 ql[128], u8 qh[64], i8 scales[16], f16 d; group g = 4h + k: q = nibble of
                 ql[64h + 32(k % 2) + j] (low for k < 2) | bits 2k, 2k+1 of qh[32h + j] << 4;
                 w = d*scales[2g + j / 16] * (q - 32)
*/
#ifndef PAGEDLLM_GGUF_BLOCKS_H
#define PAGEDLLM_GGUF_BLOCKS_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "work_items.h"

enum { Q4_0 = 2, Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

INLINE int block_elems(const int type) { return type >= Q4_K ? 256 : 32; }

INLINE int block_bytes(const int type) {
    switch (type) {
    case Q4_0: return 18;
    case Q5_0: return 22;
    case Q8_0: return 34;
    case Q4_K: return 144;
    case Q5_K: return 176;
    default: return 210;
    }
}

INLINE int has_min(const int type) { return type == Q4_K || type == Q5_K; }

/* What is subtracted from q before scaling (Q4_0, Q5_0, Q6_K), else 0. */
INLINE int q_offset(const int type) { return type == Q4_0 ? 8 : type == Q5_0 ? 16 : type == Q6_K ? 32 : 0; }

INLINE float half_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* A block's scales: a[i] multiplies the integers of scale unit i (the whole block for Q4_0 / Q5_0 / Q8_0,
   group i for Q4_K / Q5_K, 16 elements for Q6_K) and c[i] is subtracted after: a times the offset, or
   Q4_K / Q5_K's dmin * min. */
typedef struct {
    float a[16] __attribute__((aligned(32)));
    float c[16] __attribute__((aligned(32)));
} Scales;

INLINE void block_scales(const int type, const uint8_t *blk, Scales *s) {
    switch (type) {
    case Q4_0:
    case Q5_0:
    case Q8_0:
        s->a[0] = half_at(blk);
        s->c[0] = s->a[0] * (float)q_offset(type);
        break;
    case Q4_K:
    case Q5_K: {
        // Bytes 0-3 / 4-7: six low bits of scales / mins 0-3, their top two bits the high bits of scales /
        // mins 4-7; bytes 8-11: the low nibble of scale 4 + i and the high nibble of min 4 + i.
        uint32_t w0, w1, w2;
        memcpy(&w0, blk + 4, 4);
        memcpy(&w1, blk + 8, 4);
        memcpy(&w2, blk + 12, 4);
        const uint64_t sc = (uint64_t)(w0 & 0x3F3F3F3Fu)
                          | (uint64_t)((w2 & 0x0F0F0F0Fu) | ((w0 >> 2) & 0x30303030u)) << 32;
        const uint64_t mn = (uint64_t)(w1 & 0x3F3F3F3Fu)
                          | (uint64_t)(((w2 >> 4) & 0x0F0F0F0Fu) | ((w1 >> 2) & 0x30303030u)) << 32;
        const __m256 fs = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)sc)));
        const __m256 fm = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)mn)));
        _mm256_store_ps(s->a, _mm256_mul_ps(_mm256_set1_ps(half_at(blk)), fs));
        _mm256_store_ps(s->c, _mm256_mul_ps(_mm256_set1_ps(half_at(blk + 2)), fm));
        break;
    }
    default: { /* Q6_K */
        const __m128i sc = _mm_loadu_si128((const __m128i *)(blk + 192));
        const __m256 d = _mm256_set1_ps(half_at(blk + 208)), off = _mm256_set1_ps(32.0f);
        const __m256 lo = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));
        const __m256 hi = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(sc, sc))));
        _mm256_store_ps(s->a, lo);
        _mm256_store_ps(s->a + 8, hi);
        _mm256_store_ps(s->c, _mm256_mul_ps(lo, off));
        _mm256_store_ps(s->c + 8, _mm256_mul_ps(hi, off));
        break;
    }
    }
}

/* Byte j of the result is 0x10 where bit j of the 32-bit little-endian word at p is set, else 0. */
INLINE __m256i bit4_from_bits(const uint8_t *p) {
    uint32_t bits;
    memcpy(&bits, p, 4);
    // Byte j takes byte j/8 of the word, then is tested against its own bit, 1 << (j % 8).
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32((int)bits),
        _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL, 0x0101010101010101LL, 0));
    const __m256i select = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select);
    return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}

/* Group g (32 elements) of the block at blk as 32 bytes in element order, each the element's q: signed for
   Q8_0, 0..63 for the others (the offset is not subtracted here). */
INLINE __m256i group_ints(const int type, const uint8_t *blk, const int g) {
    switch (type) {
    case Q4_0:
    case Q5_0: {
        // Both 128-bit halves get the 16 bytes; the high half shifted by 4 keeps their high nibbles, so byte
        // j of the vector is element j without a cross-lane shuffle.
        const __m256i both = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(blk + (type == Q4_0 ? 2 : 6))));
        __m256i q = _mm256_and_si256(_mm256_srlv_epi32(both, _mm256_set_epi32(4, 4, 4, 4, 0, 0, 0, 0)),
                                     _mm256_set1_epi8(0x0F));
        if (type == Q5_0) q = _mm256_or_si256(q, bit4_from_bits(blk + 2));
        return q;
    }
    case Q8_0:
        return _mm256_loadu_si256((const __m256i *)(blk + 2));
    case Q4_K:
    case Q5_K: {
        __m256i q = _mm256_loadu_si256((const __m256i *)(blk + (type == Q4_K ? 16 : 48) + 32 * (g >> 1)));
        if (g & 1) q = _mm256_srli_epi16(q, 4);
        q = _mm256_and_si256(q, _mm256_set1_epi8(0x0F));
        if (type == Q5_K) {
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 16));
            const __m256i bit = _mm256_set1_epi8((char)(1 << g));
            const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit);
            q = _mm256_or_si256(q, _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
        }
        return q;
    }
    default: { /* Q6_K */
        const int h = g >> 2, k = g & 3;
        __m256i lo = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32 * (k & 1)));
        if (k >> 1) lo = _mm256_srli_epi16(lo, 4);
        lo = _mm256_and_si256(lo, _mm256_set1_epi8(0x0F));
        __m256i hi = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
        hi = _mm256_and_si256(_mm256_srli_epi16(hi, 2 * k), _mm256_set1_epi8(0x03));
        return _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
    }
    }
}

/* Group g's a (or c) per lane of a strided vector: lanes 0-3 hold elements of 0-15, lanes 4-7 of 16-31. */
INLINE __m256 group_vec(const int type, const float *v, const int g) {
    if (type == Q6_K) return _mm256_set_m128(_mm_broadcast_ss(&v[2 * g + 1]), _mm_broadcast_ss(&v[2 * g]));
    return _mm256_broadcast_ss(&v[has_min(type) ? g : 0]);
}

#endif
