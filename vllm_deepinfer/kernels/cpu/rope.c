/* V4.1's rotary embedding of the last `rope_dim` values of each row (interleaved, GPT-J
 * pairs), in place: each (even, odd) pair i of the tail is rotated by its token's angle,
 *
 *   x[2i]     = even * cos_i - odd * sin_i
 *   x[2i + 1] = odd * cos_i + even * sin_i      (sin_i negated for the inverse)
 *
 * in fp32, each product and sum rounded as torch rounds them (no fused multiply-add:
 * the build's C11 mode keeps them apart), then rounded to the row's dtype (bf16: to
 * nearest even). cos_i and sin_i come from vLLM's rotary cache [positions, rope_dim]
 * (cos in the first half, sin in the second) at the token's position. The torch twin is
 * kernels/rope.py: rotate_pairs.
 *
 * Why C: traced into vLLM's graph, the rotation's stride-2 pairs keep Inductor's code
 * scalar, and the concatenation around it copies every row value by value; here only the
 * tail is read and written, in place (the rows come fresh from a projection or the
 * attention op). Rows are split across `threads` OpenMP threads; each row is computed
 * alone. */

#include <stdint.h>

#include "bf16.h"

/* Rows ahead whose tails are fetched while a row rotates: the tails lie a row apart (1 KiB
 * for 512 bf16 values), a stride the hardware prefetcher does not follow; prefetching
 * took a 4096-row call from 240 to 140 us. */
#define PREFETCH_ROWS 8

/* One row's tail of `half` pairs, rotated in place; sign -1 for the inverse (exact). Kept
 * free of branches so that the compiler vectorizes it. */
static void rotate_f32(float *tail, const float *cos, const float *sin, float sign,
                       int64_t half) {
    for (int64_t i = 0; i < half; i++) {
        float even = tail[2 * i], odd = tail[2 * i + 1], s = sign * sin[i], c = cos[i];
        float a = even * c, b = odd * s, d = odd * c, e = even * s;
        tail[2 * i] = a - b;
        tail[2 * i + 1] = d + e;
    }
}

static void rotate_bf16(uint16_t *tail, const float *cos, const float *sin, float sign,
                        int64_t half) {
    for (int64_t i = 0; i < half; i++) {
        float even = from_bf16(tail[2 * i]), odd = from_bf16(tail[2 * i + 1]);
        float s = sign * sin[i], c = cos[i];
        float a = even * c, b = odd * s, d = odd * c, e = even * s;
        tail[2 * i] = to_bf16(a - b);
        tail[2 * i + 1] = to_bf16(d + e);
    }
}

/* x [rows, width] contiguous (fp32 or bf16, `dtype`); row r belongs to token
 * r / rows_per_token at positions[token]. Returns 0, or r + 1 where row r's position
 * lies outside the cache's `cache_rows` (that row is left as it was). */
int rope_tail(void *x, int32_t dtype, int64_t rows, int64_t width, int64_t rope_dim,
              int64_t rows_per_token, const int64_t *positions, const float *cache,
              int64_t cache_rows, int inverse, int threads) {
    int64_t half = rope_dim / 2, kept = width - rope_dim;
    float sign = inverse ? -1.0f : 1.0f;
    int64_t item = dtype == F32 ? (int64_t)sizeof(float) : (int64_t)sizeof(uint16_t);
    int failed = 0;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows > 256)
    for (int64_t r = 0; r < rows; r++) {
        int64_t position = positions[r / rows_per_token];
        if (position < 0 || position >= cache_rows) {
#pragma omp critical
            if (failed == 0 || failed > r + 1) failed = (int)(r + 1);
            continue;
        }
        const float *cos = cache + position * rope_dim, *sin = cos + half;
        if (r + PREFETCH_ROWS < rows) {
            const char *ahead = (const char *)x + ((r + PREFETCH_ROWS) * width + kept) * item;
            for (int64_t at = 0; at < rope_dim * item; at += 64) __builtin_prefetch(ahead + at, 1);
        }
        if (dtype == F32)
            rotate_f32((float *)x + r * width + kept, cos, sin, sign, half);
        else
            rotate_bf16((uint16_t *)x + r * width + kept, cos, sin, sign, half);
    }
    return failed;
}
