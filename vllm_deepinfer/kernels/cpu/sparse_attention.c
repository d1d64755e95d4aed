/* V4.1's sparse sink attention, read straight from the paged caches: every query (one
 * token, all its heads) attends over its own keys, key = value, in fp32:
 *
 *   - its top-k compressed latents, in selection order: group g of the request's
 *     compressed cache (the row at position g * ratio), where valid;
 *   - the window: the latents of positions max(pos - W + 1, first_key, 0) .. pos of the
 *     request's window cache (first_key: where a replayed window starts);
 *   - the head's sink, one more logit with a zero value.
 *
 *   out[t, h] = sum_i softmax_i(q[t, h] . key_i * scale, sink[h]) * key_i
 *
 * A cache is addressed as the plugin's PagedCache does (kv_cache/paged.py): the row of
 * (request r, position p) is in block table[r][p / block_size], at row
 * (p % block_size) / tokens_per_row; rows are fp32 or bf16 (`dtype`).
 *
 * Why C: a decode step's attention is a handful of keys per query, and the torch twin
 * (model/deepseek_v41/attention.py: the tiled path) spends its time in about thirty
 * small aten calls per layer (gathers, masks, einsums, softmax). Here each query reads
 * its keys once, from the cache, with no gather written out.
 *
 * Every (query, head) is computed alone, in the same order whatever else the call
 * holds, so a result does not depend on the batch. Queries and heads are split across
 * `threads` OpenMP threads. Addresses are checked against the block tables before any
 * read: a position outside them fails the call (returns its token + 1) instead of
 * reading another request's memory. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum dtype { F32 = 0, BF16 = 1 };

/* One paged cache: its rows, block table and layout (strides in bytes). */
typedef struct {
    const uint8_t *rows;
    int64_t block_stride, row_stride;
    int64_t num_blocks;
    const int64_t *table;
    int64_t table_width; /* entries per request */
    int64_t block_size, tokens_per_row;
    int32_t dtype;
} paged_cache;

/* The row of (request, position), or NULL where the table does not hold it. */
static const uint8_t *row_at(const paged_cache *c, int64_t request, int64_t position) {
    int64_t entry = position / c->block_size;
    if (position < 0 || entry >= c->table_width) return NULL;
    int64_t block = c->table[request * c->table_width + entry];
    if (block < 0 || block >= c->num_blocks) return NULL;
    int64_t row = (position % c->block_size) / c->tokens_per_row;
    return c->rows + block * c->block_stride + row * c->row_stride;
}

/* The row as fp32: the cache's own memory for fp32, else widened into `wide`. */
static const float *as_floats(const uint8_t *row, int32_t dtype, int64_t d, float *wide) {
    if (dtype == F32) return (const float *)row;
    const uint16_t *bits = (const uint16_t *)row;
    for (int64_t i = 0; i < d; i++) {
        uint32_t w = (uint32_t)bits[i] << 16;
        memcpy(wide + i, &w, sizeof w);
    }
    return wide;
}

static inline float dot(const float *a, const float *b, int64_t d) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < d; i++) acc += a[i] * b[i];
    return acc;
}

/* Heads [h0, h1) of token t. `keys` holds room for max_keys row pointers, `logits` for
 * (h1 - h0) * max_keys floats, `wide` for max_keys * d floats (bf16 rows). Returns 0, or
 * -1 where a key's position is outside its block table. */
static int attend(const float *q, int64_t heads, int64_t d, int64_t t, int64_t h0, int64_t h1,
                  int64_t request, int64_t position, int64_t first, const paged_cache *window,
                  int64_t w, const paged_cache *compressed, int64_t ratio, const int64_t *groups,
                  const uint8_t *valid, int64_t topk, const float *sink, float scale,
                  float *out, const float **keys, float *logits, float *wide, int64_t max_keys) {
    int64_t n = 0;
    for (int64_t j = 0; j < topk; j++) {
        if (!valid[t * topk + j]) continue;
        const uint8_t *row = row_at(compressed, request, groups[t * topk + j] * ratio);
        if (!row) return -1;
        keys[n] = as_floats(row, compressed->dtype, d, wide + n * d);
        n++;
    }
    int64_t lo = position - w + 1;
    if (lo < first) lo = first;
    if (lo < 0) lo = 0;
    for (int64_t p = lo; p <= position && n < max_keys; p++) {
        const uint8_t *row = row_at(window, request, p);
        if (!row) return -1;
        keys[n] = as_floats(row, window->dtype, d, wide + n * d);
        n++;
    }
    for (int64_t h = h0; h < h1; h++) {
        const float *qh = q + (t * heads + h) * d;
        float *l = logits + (h - h0) * max_keys;
        float top = sink[h];
        for (int64_t i = 0; i < n; i++) {
            l[i] = dot(qh, keys[i], d) * scale;
            if (l[i] > top) top = l[i];
        }
        float total = expf(sink[h] - top);
        for (int64_t i = 0; i < n; i++) {
            l[i] = expf(l[i] - top);
            total += l[i];
        }
        float *o = out + (t * heads + h) * d;
        memset(o, 0, (size_t)d * sizeof(float));
        for (int64_t i = 0; i < n; i++) {
            const float p = l[i] / total, *k = keys[i];
#pragma omp simd
            for (int64_t x = 0; x < d; x++) o[x] += p * k[x];
        }
    }
    return 0;
}

/* q, out [tokens, heads, d] fp32; per token its request (row of the block tables), its
 * position and the first window position it may read; groups / valid [tokens, topk]
 * (topk 0: a window-only layer, `compressed` unused). Returns 0; -1 if a thread's buffers
 * could not be allocated; t + 1 if token t's keys lie outside the block tables (the
 * outputs are then incomplete). */
int sparse_attention(const float *q, int64_t tokens, int64_t heads, int64_t d,
                     const int64_t *request, const int64_t *position, const int64_t *first,
                     const paged_cache *window, int64_t w, const paged_cache *compressed,
                     int64_t ratio, const int64_t *groups, const uint8_t *valid, int64_t topk,
                     const float *sink, float scale, float *out, int threads) {
    int64_t max_keys = w + topk;
    /* Few tokens (decode): split each token's heads too, so every thread has work. */
    int64_t chunks = tokens >= threads ? 1 : (threads + tokens - 1) / tokens;
    if (chunks > heads) chunks = heads;
    int64_t per_chunk = (heads + chunks - 1) / chunks;
    int64_t units = tokens * chunks;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (units > 1)
    {
        const float **keys = malloc((size_t)max_keys * sizeof(float *));
        float *logits = malloc((size_t)(per_chunk * max_keys) * sizeof(float));
        float *wide = malloc((size_t)(max_keys * d) * sizeof(float));
        int ok = keys && logits && wide;
        if (!ok) {
#pragma omp critical
            failed = -1;
        }
#pragma omp for schedule(static)
        for (int64_t u = 0; u < units; u++) {
            if (!ok) continue;
            int64_t t = u / chunks, h0 = (u % chunks) * per_chunk;
            int64_t h1 = h0 + per_chunk < heads ? h0 + per_chunk : heads;
            if (h0 >= h1) continue;
            int64_t r = request[t];
            if (attend(q, heads, d, t, h0, h1, r, position[t], first[r], window, w, compressed,
                       ratio, groups, valid, topk, sink, scale, out, keys, logits, wide,
                       max_keys)) {
#pragma omp critical
                if (failed == 0 || failed > t + 1) failed = (int)(t + 1);
            }
        }
        free(keys);
        free(logits);
        free(wide);
    }
    return failed;
}
