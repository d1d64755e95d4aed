/* V4.1's sparse attention, read straight from the paged caches: the lightning indexer's
 * scores (index_scores, near the end) and the attention itself; and the caches' row
 * writes (paged_write, at the end). Every query (one
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

#include "bf16.h"

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

/* Starts fetching a row (`write`: for a store) towards L2. A query's keys and a write's
 * destinations are rows scattered over the cache, mostly in no CPU cache: read or copied
 * one after another, each row's first miss waited for the one before. Its first
 * FETCH_LINES lines fetched ahead, the misses overlap and the hardware prefetcher
 * follows each row from there. On an AVX-512 machine, from cold caches (medians of 8
 * interleaved rounds): 32 decode queries 550 -> 509 us, a 32-row write 65 -> 59 us;
 * fetching every line of 48 key rows was slower than fetching none. The values read
 * and written are the same. */
#define FETCH_LINES 2
static inline void fetch_row(const uint8_t *row, int write) {
    for (int line = 0; line < FETCH_LINES; line++) {
        if (write)
            __builtin_prefetch(row + 64 * line, 1, 2);
        else
            __builtin_prefetch(row + 64 * line, 0, 2);
    }
}

/* The row as fp32: the cache's own memory for fp32, else widened into `wide`. */
static const float *as_floats(const uint8_t *row, int32_t dtype, int64_t d, float *wide) {
    if (dtype == F32) return (const float *)row;
    const uint16_t *bits = (const uint16_t *)row;
    for (int64_t i = 0; i < d; i++) wide[i] = from_bf16(bits[i]);
    return wide;
}

#define HEAD_BLOCK 4 /* heads that share each key read (four independent sums) */

/* SIMD forms of a full head block's two loops, used where the build targets AVX-512 or
 * AVX2 (d a multiple of 2 vectors): each (query, head) still sums in one fixed
 * order. The weighted sum keeps two vectors of each head's output in registers while
 * every key adds to them (the portable loops below go through memory once per key,
 * which made them store-bound), in their order and with their separate multiply and add:
 * the same bits. Fused multiply-adds were faster still, but moved the compiled engine's
 * logprobs away from the eager one's (tests/model/test_compiled.py) past 1e-4. bf16 rows
 * widen as they load. */
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#define VECTOR_BLOCK 1
#if defined(__AVX512F__)
#define LANES 16
typedef __m512 vec;
#define vzero _mm512_setzero_ps
#define vload _mm512_loadu_ps
#define vstore _mm512_storeu_ps
#define vmuladd(a, b, c) _mm512_add_ps(_mm512_mul_ps(a, b), c)
#define vset1 _mm512_set1_ps
#define vsum _mm512_reduce_add_ps
static inline vec vbf16(const uint16_t *bits) {
    __m256i b = _mm256_loadu_si256((const __m256i *)bits);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}
#else
#define LANES 8
typedef __m256 vec;
#define vzero _mm256_setzero_ps
#define vload _mm256_loadu_ps
#define vstore _mm256_storeu_ps
#define vmuladd(a, b, c) _mm256_add_ps(_mm256_mul_ps(a, b), c)
#define vset1 _mm256_set1_ps
static inline float vsum(vec v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline vec vbf16(const uint16_t *bits) {
    __m128i b = _mm_loadu_si128((const __m128i *)bits);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16));
}
#endif

/* LANES values of a key row from x on, fp32 or widened from bf16 (exact). */
static inline vec key_lanes(const void *row, int bf16, int64_t x) {
    return bf16 ? vbf16((const uint16_t *)row + x) : vload((const float *)row + x);
}

static inline void dots_block(const float *q, int64_t d, const void *k, int bf16,
                              float *logits, int64_t stride) {
    vec a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
    for (int64_t x = 0; x < d; x += LANES) {
        vec kx = key_lanes(k, bf16, x);
        a0 = vmuladd(vload(q + x), kx, a0);
        a1 = vmuladd(vload(q + d + x), kx, a1);
        a2 = vmuladd(vload(q + 2 * d + x), kx, a2);
        a3 = vmuladd(vload(q + 3 * d + x), kx, a3);
    }
    logits[0] = vsum(a0), logits[stride] = vsum(a1);
    logits[2 * stride] = vsum(a2), logits[3 * stride] = vsum(a3);
}

/* o_h = sum_i p[h * stride + i] * keys[i] for the HEAD_BLOCK heads of `o` (rows d apart). */
static inline void weighted_sum_block(float *o, int64_t d, const void *const *keys, int bf16,
                                      int64_t count, const float *p, int64_t stride) {
    for (int64_t x = 0; x < d; x += 2 * LANES) {
        vec s[2 * HEAD_BLOCK];
        for (int j = 0; j < 2 * HEAD_BLOCK; j++) s[j] = vzero();
        for (int64_t i = 0; i < count; i++) {
            vec k0 = key_lanes(keys[i], bf16, x), k1 = key_lanes(keys[i], bf16, x + LANES);
            for (int h = 0; h < HEAD_BLOCK; h++) {
                vec ph = vset1(p[h * stride + i]);
                s[2 * h] = vmuladd(ph, k0, s[2 * h]);
                s[2 * h + 1] = vmuladd(ph, k1, s[2 * h + 1]);
            }
        }
        for (int h = 0; h < HEAD_BLOCK; h++) {
            vstore(o + h * d + x, s[2 * h]);
            vstore(o + h * d + x + LANES, s[2 * h + 1]);
        }
    }
}
#else
#define VECTOR_BLOCK 0
#define LANES 1
#endif

/* logits[h * stride] = q_h . k for the n (1 to HEAD_BLOCK) heads at q (rows d apart). */
static inline void dots(const float *q, int64_t n, int64_t d, const float *k, float *logits,
                        int64_t stride) {
    if (n == HEAD_BLOCK) {
        const float *q0 = q, *q1 = q + d, *q2 = q + 2 * d, *q3 = q + 3 * d;
        float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
        for (int64_t x = 0; x < d; x++) {
            float kx = k[x];
            a0 += q0[x] * kx;
            a1 += q1[x] * kx;
            a2 += q2[x] * kx;
            a3 += q3[x] * kx;
        }
        logits[0] = a0, logits[stride] = a1, logits[2 * stride] = a2, logits[3 * stride] = a3;
        return;
    }
    for (int64_t h = 0; h < n; h++) {
        float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
        for (int64_t x = 0; x < d; x++) acc += q[h * d + x] * k[x];
        logits[h * stride] = acc;
    }
}

/* o_h += p[h * stride] * k for the n heads of `o` (rows d apart). */
static inline void accumulate(float *o, int64_t n, int64_t d, const float *k, const float *p,
                              int64_t stride) {
    if (n == HEAD_BLOCK) {
        float *o0 = o, *o1 = o + d, *o2 = o + 2 * d, *o3 = o + 3 * d;
        const float p0 = p[0], p1 = p[stride], p2 = p[2 * stride], p3 = p[3 * stride];
#pragma omp simd
        for (int64_t x = 0; x < d; x++) {
            float kx = k[x];
            o0[x] += p0 * kx;
            o1[x] += p1 * kx;
            o2[x] += p2 * kx;
            o3[x] += p3 * kx;
        }
        return;
    }
    for (int64_t h = 0; h < n; h++) {
        const float ph = p[h * stride];
#pragma omp simd
        for (int64_t x = 0; x < d; x++) o[h * d + x] += ph * k[x];
    }
}

/* A failed call's code: -1 (no memory) or the first failing item + 1, whichever thread
 * finds it. */
static void record_failure(int *failed, int code) {
#pragma omp critical
    if (*failed == 0 || (code > 0 && *failed > code)) *failed = code;
}

/* Heads [h0, h1) of token t (h0 a multiple of HEAD_BLOCK): q and out hold their rows
 * (fp32, d apart) from head h0 on. `keys` holds room for max_keys
 * row pointers, `logits` for (h1 - h0) * max_keys floats, `wide` for max_keys * d floats (bf16 rows). Returns 0, or
 * -1 where a key's position is outside its block table. */
static int attend(const float *q, int64_t d, int64_t t, int64_t h0, int64_t h1,
                  int64_t request, int64_t position, int64_t first, const paged_cache *window,
                  int64_t w, const paged_cache *compressed, int64_t ratio, const int64_t *groups,
                  const uint8_t *valid, int64_t topk, const float *sink, float scale,
                  float *out, const float **keys, float *logits, float *wide, int64_t max_keys) {
    /* A whole head block of a width the vector loops take runs them (the choice depends
     * on the block alone, not on how the call was split). Where every block does, bf16
     * rows are read in place (widened as they go: the same values); otherwise each key
     * is widened once into `wide`. */
    int vector_width = VECTOR_BLOCK && d % (2 * LANES) == 0;
    int in_place = vector_width && (h1 - h0) % HEAD_BLOCK == 0 && window->dtype == BF16 &&
                   (topk == 0 || compressed->dtype == BF16);
    int64_t n = 0;
    for (int64_t j = 0; j < topk; j++) {
        if (!valid[t * topk + j]) continue;
        const uint8_t *row = row_at(compressed, request, groups[t * topk + j] * ratio);
        if (!row) return -1;
        fetch_row(row, 0);
        keys[n] = in_place ? (const float *)row : as_floats(row, compressed->dtype, d, wide + n * d);
        n++;
    }
    int64_t lo = position - w + 1;
    if (lo < first) lo = first;
    if (lo < 0) lo = 0;
    for (int64_t p = lo; p <= position && n < max_keys; p++) {
        const uint8_t *row = row_at(window, request, p);
        if (!row) return -1;
        fetch_row(row, 0);
        keys[n] = in_place ? (const float *)row : as_floats(row, window->dtype, d, wide + n * d);
        n++;
    }
    /* Heads in blocks of HEAD_BLOCK from h0 (a multiple of it), each key read once per
     * block: logits, then each head's softmax with its sink, then the weighted keys. */
    for (int64_t hb = h0; hb < h1; hb += HEAD_BLOCK) {
        int64_t m = h1 - hb < HEAD_BLOCK ? h1 - hb : HEAD_BLOCK;
        const float *qb = q + (hb - h0) * d;
        int vector = vector_width && m == HEAD_BLOCK;
#if VECTOR_BLOCK
        if (vector)
            for (int64_t i = 0; i < n; i++)
                dots_block(qb, d, keys[i], in_place, logits + i, max_keys);
#endif
        if (!vector)
            for (int64_t i = 0; i < n; i++) dots(qb, m, d, keys[i], logits + i, max_keys);
        for (int64_t h = 0; h < m; h++) {
            float *l = logits + h * max_keys, top = sink[hb + h];
            for (int64_t i = 0; i < n; i++) {
                l[i] *= scale;
                if (l[i] > top) top = l[i];
            }
            float total = expf(sink[hb + h] - top);
            for (int64_t i = 0; i < n; i++) {
                l[i] = expf(l[i] - top);
                total += l[i];
            }
            for (int64_t i = 0; i < n; i++) l[i] /= total;
        }
        float *ob = out + (hb - h0) * d;
#if VECTOR_BLOCK
        if (vector) {
            weighted_sum_block(ob, d, (const void *const *)keys, in_place, n, logits, max_keys);
            continue;
        }
#endif
        memset(ob, 0, (size_t)(m * d) * sizeof(float));
        for (int64_t i = 0; i < n; i++) accumulate(ob, m, d, keys[i], logits + i, max_keys);
    }
    return 0;
}

/* q, out [tokens, heads, d], fp32 or bf16 (`q_dtype`, `out_dtype`: bf16 queries widen
 * exactly, bf16 outputs are rounded as torch rounds, so either gives the bits of an fp32
 * call and a conversion outside it); per token its request (row of the block tables), its
 * position and the first window position it may read; groups / valid [tokens, topk]
 * (topk 0: a window-only layer, `compressed` unused). Returns 0; -1 if a thread's buffers
 * could not be allocated; t + 1 if token t's keys lie outside the block tables (the
 * outputs are then incomplete). */
int sparse_attention(const void *q, int32_t q_dtype, int64_t tokens, int64_t heads, int64_t d,
                     const int64_t *request, const int64_t *position, const int64_t *first,
                     const paged_cache *window, int64_t w, const paged_cache *compressed,
                     int64_t ratio, const int64_t *groups, const uint8_t *valid, int64_t topk,
                     const float *sink, float scale, void *out, int32_t out_dtype,
                     int threads) {
    int64_t max_keys = w + topk;
    /* Few tokens (decode): split each token's heads too, so every thread has work. */
    int64_t chunks = tokens >= threads ? 1 : (threads + tokens - 1) / tokens;
    if (chunks > heads) chunks = heads;
    /* Chunks of whole head blocks: a head's block, hence its arithmetic, does not depend
     * on how the call was split. */
    int64_t per_chunk = (heads + chunks - 1) / chunks;
    per_chunk = (per_chunk + HEAD_BLOCK - 1) / HEAD_BLOCK * HEAD_BLOCK;
    int64_t units = tokens * chunks;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (units > 1)
    {
        const float **keys = malloc((size_t)max_keys * sizeof(float *));
        float *logits = malloc((size_t)(per_chunk * max_keys) * sizeof(float));
        float *wide = malloc((size_t)(max_keys * d) * sizeof(float));
        /* fp32 rows of a bf16 chunk's queries and output (none where both are fp32). */
        int widened = q_dtype != F32 || out_dtype != F32;
        float *rows = widened ? malloc((size_t)(2 * per_chunk * d) * sizeof(float)) : NULL;
        int ok = keys && logits && wide && (rows || !widened);
        if (!ok) record_failure(&failed, -1);
#pragma omp for schedule(static)
        for (int64_t u = 0; u < units; u++) {
            if (!ok) continue;
            int64_t t = u / chunks, h0 = (u % chunks) * per_chunk;
            int64_t h1 = h0 + per_chunk < heads ? h0 + per_chunk : heads;
            if (h0 >= h1) continue;
            int64_t r = request[t], first_value = (t * heads + h0) * d, values = (h1 - h0) * d;
            const float *qt = q_dtype == F32 ? (const float *)q + first_value
                                             : as_floats((const uint8_t *)q + 2 * first_value,
                                                         BF16, values, rows);
            float *ot = out_dtype == F32 ? (float *)out + first_value : rows + per_chunk * d;
            if (attend(qt, d, t, h0, h1, r, position[t], first[r], window, w, compressed, ratio,
                       groups, valid, topk, sink, scale, ot, keys, logits, wide, max_keys))
                record_failure(&failed, (int)(t + 1));
            if (out_dtype == BF16)
                for (int64_t x = 0; x < values; x++)
                    ((uint16_t *)out)[first_value + x] = to_bf16(ot[x]);
        }
        free(keys);
        free(logits);
        free(wide);
        free(rows);
    }
    return failed;
}

/* The lightning indexer's scores from the paged index keys: row i (token tokens[i] of
 * request requests[i]) scores the compressed groups g < visible[i],
 *   scores[i, g] = sum_h w[t, h] * relu(q[t, h] . key(g)),  key(g) at position g * ratio,
 * and gets 0 for the groups [visible[i], groups) it may not see (the caller masks them).
 * q [T, heads, d] and w [T, heads] fp32, scores [rows, groups]. Rows and chunks of
 * KEY_CHUNK groups are split across threads; a score is computed alone, in one order.
 * Returns 0, -1 (no memory), or i + 1 if row i's keys lie outside the block table. */
#define KEY_CHUNK 256

int index_scores(const float *q, const float *w, int64_t heads, int64_t d,
                 const int64_t *tokens, const int64_t *requests, const int64_t *visible,
                 int64_t rows, int64_t groups, const paged_cache *keys, int64_t ratio,
                 float *scores, int threads) {
    int64_t chunks = (groups + KEY_CHUNK - 1) / KEY_CHUNK, units = rows * chunks;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (units > 1)
    {
        float *dots_buffer = malloc((size_t)heads * sizeof(float));
        float *wide = malloc((size_t)d * sizeof(float));
        int ok = dots_buffer && wide;
        if (!ok) record_failure(&failed, -1);
#pragma omp for schedule(static)
        for (int64_t u = 0; u < units; u++) {
            if (!ok) continue;
            int64_t i = u / chunks, g0 = (u % chunks) * KEY_CHUNK;
            int64_t g1 = g0 + KEY_CHUNK < groups ? g0 + KEY_CHUNK : groups;
            int64_t t = tokens[i], seen = visible[i] < g1 ? visible[i] : g1;
            const float *qt = q + t * heads * d, *wt = w + t * heads;
            float *row = scores + i * groups;
            for (int64_t g = g0; g < g1; g++) row[g] = 0.0f;
            for (int64_t g = g0; g < seen; g++) {
                const uint8_t *stored = row_at(keys, requests[i], g * ratio);
                if (!stored) {
                    record_failure(&failed, (int)(i + 1));
                    break;
                }
                const float *k = as_floats(stored, keys->dtype, d, wide);
                for (int64_t h = 0; h < heads; h += HEAD_BLOCK) {
                    int64_t m = heads - h < HEAD_BLOCK ? heads - h : HEAD_BLOCK;
                    dots(qt + h * d, m, d, k, dots_buffer + h, 1);
                }
                float sum = 0.0f;
                for (int64_t h = 0; h < heads; h++)
                    sum += wt[h] * (dots_buffer[h] > 0.0f ? dots_buffer[h] : 0.0f);
                row[g] = sum;
            }
        }
        free(dots_buffer);
        free(wide);
    }
    return failed;
}

/* One row into the cache, converted to its dtype as torch converts. */
static void write_row(uint8_t *dst, const uint8_t *src, int32_t rows_dtype, int32_t dtype,
                      int64_t width) {
    if (rows_dtype == dtype) {
        memcpy(dst, src, (size_t)width * (dtype == F32 ? 4 : 2));
    } else if (dtype == F32) { /* bf16 rows widen exactly, straight into the row */
        as_floats(src, BF16, width, (float *)dst);
    } else {
        const float *values = (const float *)src;
        for (int64_t x = 0; x < width; x++) ((uint16_t *)dst)[x] = to_bf16(values[x]);
    }
}

/* The cache row of token slot `slot` (>= 0, its block checked by the caller), writable:
 * the reading kernels' view of the cache, written here. */
static uint8_t *slot_row(const paged_cache *c, int64_t slot) {
    return (uint8_t *)c->rows + slot / c->block_size * c->block_stride +
           (slot % c->block_size) / c->tokens_per_row * c->row_stride;
}

/* Rows ahead of the one being written whose destinations are fetched (paged_write). */
#define WRITE_AHEAD 8

/* Stores n rows of `width` values (fp32 or bf16, `rows_dtype`; row i at rows + i *
 * rows_stride bytes) at token slots of cache c: slot s is row (s % block_size) /
 * tokens_per_row of block s / block_size; slot -1 (padding, replayed rows) is skipped.
 * The write side of the cache layout the kernels above read (kv_cache/paged.py:
 * PagedCache.write, its torch twin, takes a dozen aten calls for a decode step's row).
 * Returns 0, or i + 1 where slot i lies outside the cache (the rows before it are
 * written, none after). */
int paged_write(const paged_cache *c, const int64_t *slots, int64_t n, const uint8_t *rows,
                int32_t rows_dtype, int64_t rows_stride, int64_t width) {
    int64_t valid = 0; /* the rows before the first slot outside the cache */
    while (valid < n && slots[valid] / c->block_size < c->num_blocks) valid++;
    for (int64_t i = 0; i < valid + WRITE_AHEAD; i++) {
        if (i < valid && slots[i] >= 0) fetch_row(slot_row(c, slots[i]), 1);
        int64_t at = i - WRITE_AHEAD; /* fetched WRITE_AHEAD rows ago */
        if (at < 0 || at >= valid || slots[at] < 0) continue;
        write_row(slot_row(c, slots[at]), rows + at * rows_stride, rows_dtype, c->dtype, width);
    }
    return valid < n ? (int)(valid + 1) : 0;
}
