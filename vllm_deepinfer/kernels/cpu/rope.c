/* V4.1's rotary embedding of the last `rope_dim` values of each row (interleaved, GPT-J
 * pairs), into a new tensor: out = x with each (even, odd) pair i of the tail rotated by
 * its token's angle,
 *
 *   out[2i]     = even * cos_i - odd * sin_i
 *   out[2i + 1] = odd * cos_i + even * sin_i      (sin_i negated for the inverse)
 *
 * in fp32, each product and sum rounded as torch rounds them (no fused multiply-add:
 * the build's C11 mode keeps them apart), then rounded to the row's dtype (bf16: to
 * nearest even). cos_i and sin_i come from vLLM's rotary cache [positions, rope_dim]
 * (cos in the first half, sin in the second) at the token's position. The torch twin is
 * kernels/rope.py: rotate_pairs.
 *
 * Why C: traced into vLLM's graph, the rotation's stride-2 pairs keep Inductor's code
 * scalar, and the concatenation around it copies every row value by value; here the
 * rest of a row is one memcpy and the pairs a short loop. Rows are split across
 * `threads` OpenMP threads; each row is computed alone. */

#include <stdint.h>
#include <string.h>

#include "bf16.h"

/* x, out [rows, width] contiguous (fp32 or bf16, `dtype`); row r belongs to token
 * r / rows_per_token at positions[token]. Returns 0, or r + 1 where row r's position
 * lies outside the cache's `cache_rows` (nothing is read there). */
int rope_tail(const void *x, void *out, int32_t dtype, int64_t rows, int64_t width,
              int64_t rope_dim, int64_t rows_per_token, const int64_t *positions,
              const float *cache, int64_t cache_rows, int inverse, int threads) {
    int64_t half = rope_dim / 2, kept = width - rope_dim;
    size_t item = dtype == F32 ? sizeof(float) : sizeof(uint16_t);
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
        const uint8_t *src = (const uint8_t *)x + (size_t)(r * width) * item;
        uint8_t *dst = (uint8_t *)out + (size_t)(r * width) * item;
        memcpy(dst, src, (size_t)kept * item);
        for (int64_t i = 0; i < half; i++) {
            float even, odd, s = inverse ? -sin[i] : sin[i], c = cos[i];
            if (dtype == F32) {
                even = ((const float *)src)[kept + 2 * i];
                odd = ((const float *)src)[kept + 2 * i + 1];
            } else {
                even = from_bf16(((const uint16_t *)src)[kept + 2 * i]);
                odd = from_bf16(((const uint16_t *)src)[kept + 2 * i + 1]);
            }
            float a = even * c, b = odd * s, first = a - b;
            float d = odd * c, e = even * s, second = d + e;
            if (dtype == F32) {
                ((float *)dst)[kept + 2 * i] = first;
                ((float *)dst)[kept + 2 * i + 1] = second;
            } else {
                ((uint16_t *)dst)[kept + 2 * i] = to_bf16(first);
                ((uint16_t *)dst)[kept + 2 * i + 1] = to_bf16(second);
            }
        }
    }
    return failed;
}
