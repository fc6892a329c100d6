/* RMSNorm (with the residual add fused) and rotary embedding over float32 rows, for the CPU decode step.

   A decode step of a small model makes ~100 norm and ~20 rotary calls on rows of a few hundred floats;
   as torch ops each is ~9 kernel launches and temporaries, which cost more than the arithmetic. Here each
   is one pass over its rows.

   RMSNorm of a row x of H floats: s = x (+ residual), r = 1 / sqrt(mean(s * s) + eps), out = s * r * w,
   or s * r * (1 + w) for Gemma's weights stored as offsets from 1: torch's operations in torch's order,
   the sum of squares included (sum_squares), so the result equals the torch path's.

   Rotary of one head's first R channels at angle theta_i = position * inv_freq_i, given cos and sin:
     neox: pairs (i, i + R/2):  a' = a cos - b sin,  b' = b cos + a sin
     gptj: pairs (2i, 2i + 1):  the same formulas.
   Built with -ffp-contract=off: each product is rounded before the subtraction, as torch's separate
   multiply and subtract round it, so rotated values equal torch's bit for bit.
*/
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

/* Rows at and above this count are split between threads; below it a thread's start costs more than it saves. */
#define PARALLEL_ROWS 64

/* sum_j s_j^2 in the order torch's CPU sum of a contiguous row adds (ATen's cascade sum): the row is read
   as vectors of `lanes` floats (torch's vector width: 8 for AVX2, 16 for AVX-512), vector v going to
   accumulator v % 4; each accumulator sums its vectors in cascade levels of 2^p (p >= 4); the leftover
   vectors join accumulator 0, the four accumulators are added in order, then the leftover floats and
   the lanes. Matching that order makes the norms equal to torch's (and HF's) bit for bit. */
#define ILP 4
#define LEVELS 4
#define MAX_LANES 16

static int ceil_log2(int64_t x) {
    int r = 0;
    while (((int64_t)1 << r) < x)
        r++;
    return r;
}

static float sum_squares(const float *s, int64_t n, int lanes) {
    const int64_t vecs = n / lanes, rows = vecs / ILP;
    float acc[LEVELS][ILP][MAX_LANES] = {{{0}}};
    const int power = ceil_log2(rows) / LEVELS > 4 ? ceil_log2(rows) / LEVELS : 4;
    const int64_t step = (int64_t)1 << power, mask = step - 1;
    int64_t i = 0;
    while (i + step <= rows) {
        for (int64_t j = 0; j < step; j++, i++)
            for (int k = 0; k < ILP; k++)
                for (int l = 0; l < lanes; l++) {
                    const float v = s[(i * ILP + k) * lanes + l];
                    acc[0][k][l] += v * v;
                }
        for (int lev = 1; lev < LEVELS; lev++) {
            for (int k = 0; k < ILP; k++)
                for (int l = 0; l < lanes; l++) {
                    acc[lev][k][l] += acc[lev - 1][k][l];
                    acc[lev - 1][k][l] = 0.0f;
                }
            if (i & (mask << (lev * power)))
                break;
        }
    }
    for (; i < rows; i++)
        for (int k = 0; k < ILP; k++)
            for (int l = 0; l < lanes; l++) {
                const float v = s[(i * ILP + k) * lanes + l];
                acc[0][k][l] += v * v;
            }
    for (int lev = 1; lev < LEVELS; lev++)
        for (int k = 0; k < ILP; k++)
            for (int l = 0; l < lanes; l++)
                acc[0][k][l] += acc[lev][k][l];
    for (int64_t v = rows * ILP; v < vecs; v++)
        for (int l = 0; l < lanes; l++)
            acc[0][0][l] += s[v * lanes + l] * s[v * lanes + l];
    for (int k = 1; k < ILP; k++)
        for (int l = 0; l < lanes; l++)
            acc[0][0][l] += acc[0][k][l];
    float total = 0.0f;
    for (int64_t j = vecs * lanes; j < n; j++)
        total += s[j] * s[j];
    for (int l = 0; l < lanes; l++)
        total += acc[0][0][l];
    return total;
}

/* One row: s = x (+ res), written to res_out when res is given; out = s * r * w (or * (1 + w)). */
static void norm_row(const float *x, const float *res, float *res_out, float *out, const float *w, int64_t n,
                     float eps, int gemma, int lanes) {
    const float *s = x;
    if (res) {
        for (int64_t j = 0; j < n; j++)
            res_out[j] = x[j] + res[j];
        s = res_out;
    }
    /* torch sums a row shorter than one vector float by float, in the same four-way cascade. */
    const float r = 1.0f / sqrtf(sum_squares(s, n, n < lanes ? 1 : lanes) / (float)n + eps);
    if (gemma) {
        for (int64_t j = 0; j < n; j++)
            out[j] = (s[j] * r) * (1.0f + w[j]);
    } else {
        for (int64_t j = 0; j < n; j++)
            out[j] = w[j] * (s[j] * r);
    }
}

/* rows x n: row i of x starts at x + (i / heads) * x_tok + (i % heads) * x_head (a [T, heads, n] view of a
   wider buffer, e.g. q inside a fused qkv output); res, res_out and out are contiguous [rows, n]. */
void rms_norm_f32(const float *x, int64_t x_tok, int64_t x_head, int64_t heads, const float *res, float *res_out,
                  float *out, int64_t rows, int64_t n, const float *w, float eps, int gemma, int lanes, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows >= PARALLEL_ROWS && threads > 1)
    for (int64_t i = 0; i < rows; i++) {
        const float *xi = x + (i / heads) * x_tok + (i % heads) * x_head;
        norm_row(xi, res ? res + i * n : 0, res ? res_out + i * n : 0, out + i * n, w, n, eps, gemma, lanes);
    }
}

/* In place on x [T, heads, D] (strides x_tok, x_head; channels contiguous): the first R = 2 * half channels
   of every head of token t rotated by cos[t], sin[t] ([T, half] contiguous). */
void rotary_f32(float *x, int64_t tokens, int64_t heads, int64_t x_tok, int64_t x_head, const float *cos_t,
                const float *sin_t, int64_t half, int neox, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (tokens * heads >= PARALLEL_ROWS && threads > 1)
    for (int64_t i = 0; i < tokens * heads; i++) {
        const int64_t t = i / heads;
        float *h = x + t * x_tok + (i % heads) * x_head;
        const float *c = cos_t + t * half, *s = sin_t + t * half;
        if (neox) {
            float *a = h, *b = h + half;
            for (int64_t j = 0; j < half; j++) {
                const float aj = a[j], bj = b[j];
                a[j] = aj * c[j] - bj * s[j];
                b[j] = bj * c[j] + aj * s[j];
            }
        } else {
            for (int64_t j = 0; j < half; j++) {
                const float aj = h[2 * j], bj = h[2 * j + 1];
                h[2 * j] = aj * c[j] - bj * s[j];
                h[2 * j + 1] = bj * c[j] + aj * s[j];
            }
        }
    }
}
