/* Weight-only products for few activation rows (decode): y[m, o] = sum_k x[m, k] * W[o, k],
 * W read once as stored and widened in registers, never written out wide.
 *
 *   MXFP4: values [O, K/2] bytes, two e2m1 codes a byte (element 2j in the low nibble),
 *          scale [O, K/32] UE8M0 bytes.
 *   MXFP8: values [O, K] e4m3 bytes, scale [O/32, K/32] UE8M0 bytes.
 *   BF16:  values [O, K] bf16 (the head, dense experts), no scale.
 *   F32:   values [O, K] fp32 (dense experts of an fp32 model), no scale.
 *
 * x is fp32 [M, K] (row stride K), y fp32 [M, O] (row stride O). Row strides of values
 * and scale are given in bytes (an expert's slice of a stacked parameter is a view).
 *
 * Every weight is widened exactly (the code's value as checkpoint/mx_formats.py decodes
 * it, before its power-of-two scale). Each 32-value block's four 8-lane chunks are
 * multiplied with x and summed as (c0 + c1) + (c2 + c3), each pair one multiply and one
 * fused multiply-add; the block's sum times its scale is added to accumulator b % 2; the
 * two accumulators are summed and reduced lane by lane in a fixed order. That arithmetic
 * does not depend on M or on which rows run together, so an output row's value does not
 * depend on the batch. The torch twins (kernels/mx_matmul.py: dequantized_rows, then a
 * matmul; a plain matmul for bf16) are the reference in tests/kernels/test_weight_gemv.py.
 *
 * Built once per machine with -march=native (kernels/cpu_build.py); the AVX2 + FMA + F16C
 * path runs wherever the compiler targets them (AVX-512 machines included), a scalar path
 * of the same arithmetic elsewhere. Rows are split across `threads` OpenMP threads. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define MX_AVX2 1
#else
#define MX_AVX2 0
#endif

#define BLOCK 32
#define PAIR 2 /* activation rows that share one widened block in registers */

enum format { MXFP8 = 0, MXFP4 = 1, BF16 = 2, F32 = 3 };

static float ue8m0[256]; /* 2**(b - 127) */

int weight_gemv_simd(void) { return MX_AVX2; }

void weight_gemv_init(void) {
    for (int b = 0; b < 256; b++) ue8m0[b] = ldexpf(1.0f, b - 127);
}

static inline float block_scale(const uint8_t *scales, int format, int64_t b) {
    return format == BF16 || format == F32 ? 1.0f : ue8m0[scales[b]];
}

#if MX_AVX2

/* e2m1 code -> the high byte of its value in fp16 (every e2m1 value's low byte is 0). */
static const uint8_t E2M1_HALF_HIGH[16] = {0x00, 0x38, 0x3C, 0x3E, 0x40, 0x42, 0x44, 0x46,
                                           0x80, 0xB8, 0xBC, 0xBE, 0xC0, 0xC2, 0xC4, 0xC6};

static inline float lanes_sum(__m256 v) {
    /* Fixed order: (l0+l4, l1+l5, l2+l6, l3+l7), then pairs, then the last two. */
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

/* One 32-value MXFP4 block (16 bytes) as four 8-lane vectors, through fp16. */
static inline void mxfp4_block(const uint8_t *q, __m256 w[4]) {
    const __m128i lut = _mm_loadu_si128((const __m128i *)E2M1_HALF_HIGH);
    const __m128i nibble = _mm_set1_epi8(0x0F);
    const __m128i zero = _mm_setzero_si128();
    __m128i bytes = _mm_loadu_si128((const __m128i *)q);
    __m128i lo = _mm_shuffle_epi8(lut, _mm_and_si128(bytes, nibble));
    __m128i hi = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble));
    __m128i first = _mm_unpacklo_epi8(lo, hi);  /* elements 0..15, high bytes */
    __m128i second = _mm_unpackhi_epi8(lo, hi); /* elements 16..31 */
    w[0] = _mm256_cvtph_ps(_mm_unpacklo_epi8(zero, first));
    w[1] = _mm256_cvtph_ps(_mm_unpackhi_epi8(zero, first));
    w[2] = _mm256_cvtph_ps(_mm_unpacklo_epi8(zero, second));
    w[3] = _mm256_cvtph_ps(_mm_unpackhi_epi8(zero, second));
}

/* Eight e4m3 bytes as fp32: sign and the seven low bits moved into place give the value
 * times 2**-120 for normals and subnormals alike; 2**120 restores it. */
static inline __m256 e4m3_eight(const uint8_t *q) {
    __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)q));
    __m256i sign = _mm256_slli_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0x80)), 24);
    __m256i rest = _mm256_slli_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0x7F)), 20);
    __m256 raw = _mm256_castsi256_ps(_mm256_or_si256(sign, rest));
    return _mm256_mul_ps(raw, _mm256_set1_ps(0x1p120f));
}

/* bf16 is the top half of fp32. */
static inline __m256 bf16_eight(const uint8_t *q) {
    __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)q));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

/* Block b of a row, widened (unscaled). */
static inline void block(const uint8_t *values, int format, int64_t b, __m256 w[4]) {
    if (format == MXFP4) {
        mxfp4_block(values + b * 16, w);
    } else if (format == MXFP8) {
        for (int c = 0; c < 4; c++) w[c] = e4m3_eight(values + b * BLOCK + 8 * c);
    } else if (format == BF16) {
        for (int c = 0; c < 4; c++) w[c] = bf16_eight(values + b * 2 * BLOCK + 16 * c);
    } else {
        for (int c = 0; c < 4; c++) w[c] = _mm256_loadu_ps((const float *)values + b * BLOCK + 8 * c);
    }
}

/* One block's sum against x: (c0 + c1) + (c2 + c3). */
static inline __m256 block_sum(const __m256 w[4], const float *x) {
    __m256 a = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(x + 8), _mm256_mul_ps(w[0], _mm256_loadu_ps(x)));
    __m256 b = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(x + 24),
                               _mm256_mul_ps(w[2], _mm256_loadu_ps(x + 16)));
    return _mm256_add_ps(a, b);
}

/* Output row o for activation rows [0, m): each block widened once when m <= PAIR, else
 * once into `wide` (K floats, this thread's), then read per pair of rows. */
static void one_row(const float *x, int64_t m, int64_t k, const uint8_t *values,
                    const uint8_t *scales, int format, float *wide, float *y, int64_t ystride) {
    int64_t blocks = k / BLOCK;
    if (m > PAIR) {
        for (int64_t b = 0; b < blocks; b++) {
            __m256 w[4];
            block(values, format, b, w);
            for (int c = 0; c < 4; c++) _mm256_storeu_ps(wide + b * BLOCK + 8 * c, w[c]);
        }
    }
    for (int64_t r0 = 0; r0 < m; r0 += PAIR) {
        int rows = (int)(m - r0 < PAIR ? m - r0 : PAIR);
        __m256 acc[PAIR][2];
        for (int r = 0; r < PAIR; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
        const float *xr = x + r0 * k;
        for (int64_t b = 0; b < blocks; b++) {
            __m256 w[4];
            if (m > PAIR) {
                for (int c = 0; c < 4; c++) w[c] = _mm256_loadu_ps(wide + b * BLOCK + 8 * c);
            } else {
                block(values, format, b, w);
            }
            __m256 scale = _mm256_set1_ps(block_scale(scales, format, b));
            for (int r = 0; r < rows; r++)
                acc[r][b & 1] =
                    _mm256_fmadd_ps(block_sum(w, xr + r * k + b * BLOCK), scale, acc[r][b & 1]);
        }
        for (int r = 0; r < rows; r++)
            y[(r0 + r) * ystride] = lanes_sum(_mm256_add_ps(acc[r][0], acc[r][1]));
    }
}

#else /* the same arithmetic, one lane at a time */

/* e2m1 code -> its value. */
static const float E2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                               -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

static inline float from_bits(uint32_t u) {
    union {
        uint32_t u;
        float f;
    } bits;
    bits.u = u;
    return bits.f;
}

static inline float widened(const uint8_t *values, int format, int64_t i) {
    if (format == MXFP4) {
        uint8_t byte = values[i / 2];
        return E2M1[i % 2 ? byte >> 4 : byte & 0x0F];
    }
    if (format == MXFP8) {
        uint8_t byte = values[i];
        return from_bits(((uint32_t)(byte & 0x80) << 24) | ((uint32_t)(byte & 0x7F) << 20)) *
               0x1p120f;
    }
    if (format == F32) return ((const float *)values)[i];
    /* bf16, little-endian as torch stores it */
    return from_bits((uint32_t)(values[2 * i] | (values[2 * i + 1] << 8)) << 16);
}

static void one_row(const float *x, int64_t m, int64_t k, const uint8_t *values,
                    const uint8_t *scales, int format, float *wide, float *y, int64_t ystride) {
    int64_t blocks = k / BLOCK;
    for (int64_t i = 0; i < k; i++) wide[i] = widened(values, format, i);
    for (int64_t r = 0; r < m; r++) {
        float acc[2][8] = {{0}};
        for (int64_t b = 0; b < blocks; b++) {
            float scale = block_scale(scales, format, b);
            for (int l = 0; l < 8; l++) {
                const float *w = wide + b * BLOCK + l, *xr = x + r * k + b * BLOCK + l;
                float a = fmaf(w[8], xr[8], w[0] * xr[0]);
                float c = fmaf(w[24], xr[24], w[16] * xr[16]);
                acc[b & 1][l] = fmaf(a + c, scale, acc[b & 1][l]);
            }
        }
        float lanes[8], s[4];
        for (int l = 0; l < 8; l++) lanes[l] = acc[0][l] + acc[1][l];
        for (int l = 0; l < 4; l++) s[l] = lanes[l] + lanes[l + 4];
        y[r * ystride] = (s[0] + s[2]) + (s[1] + s[3]);
    }
}

#endif

/* The scales of output row o (NULL for unscaled formats). */
static inline const uint8_t *row_scales(const uint8_t *scale, int64_t stride, int format,
                                        int64_t o) {
    return format == MXFP4 ? scale + o * stride
           : format == MXFP8 ? scale + (o / BLOCK) * stride
                             : NULL;
}

/* y [m, rows] = x [m, k] @ W.T (k a multiple of 32); returns 0, or -1 if a thread's row
 * buffer could not be allocated (its rows are then left unwritten). */
int weight_gemv(const float *x, int64_t m, int64_t k, const uint8_t *values,
                int64_t values_stride, const uint8_t *scale, int64_t scale_stride, int64_t rows,
                int format, float *y, int threads) {
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *wide = (float *)malloc((size_t)k * sizeof(float));
        failed = wide == NULL;
#pragma omp for schedule(static)
        for (int64_t o = 0; o < rows; o++) {
            if (!wide) continue;
            one_row(x, m, k, values + o * values_stride, row_scales(scale, scale_stride, format, o),
                    format, wide, y + o, rows);
        }
        free(wide);
    }
    return failed ? -1 : 0;
}

/* One stack of experts' weights as stored: expert e's row o at values + e * expert +
 * o * row (bytes), its scales likewise (scale_expert, scale_row). */
typedef struct {
    const uint8_t *values;
    int64_t expert, row;
    const uint8_t *scale;
    int64_t scale_expert, scale_row;
} expert_stack;

static inline void expert_row(const expert_stack *w, int format, int64_t e, int64_t o,
                              const uint8_t **values, const uint8_t **scales) {
    *values = w->values + e * w->expert + o * w->row;
    *scales = w->scale ? row_scales(w->scale + e * w->scale_expert, w->scale_row, format, o) : NULL;
}

/* V4.1's routed experts for few tokens (decode), every (token, slot) pair through its own
 * expert, weights read as stored:
 *   [g | u] = W13[e] @ x[t],  a = silu(min(g, limit)) * clamp(u, -limit, limit),
 *   out[t] = sum over slots j, in order, of weight[t, j] * (W2[e] @ a),  e = chosen[t, j].
 * The pairs are grouped by expert (in pair order within each) and each output row of an
 * expert runs once for all its pairs: the row is widened once and its blocks shared, and
 * one_row's arithmetic per (row, pair) does not depend on how many run together, so a
 * pair's result is the same whatever else the call holds. x [t, h] and out [t, h] fp32;
 * scratch holds t * k * (3 * inter + 2 * h) floats. The torch twin is the model's
 * grouped_experts (model/deepseek_v41/moe.py). Returns 0; -1 if a buffer could not be
 * allocated; -2 (before reading anything) if a chosen expert lies outside [0, experts). */
int routed_experts(const float *x, int64_t t, int64_t h, int64_t k, const int64_t *chosen,
                   const float *weights, int64_t inter, int format, int64_t experts,
                   const expert_stack *w13, const expert_stack *w2, float limit, float *scratch,
                   float *out, int threads) {
    int64_t pairs = t * k;
    for (int64_t p = 0; p < pairs; p++)
        if (chosen[p] < 0 || chosen[p] >= experts) return -2;
    /* In expert order: each pair's row of x, its [g | u], activation and W2 output. */
    float *rows = scratch, *gate_up = rows + pairs * h, *act = gate_up + pairs * 2 * inter,
          *down = act + pairs * inter;
    /* first[e]: expert e's first sorted pair; used: the experts with pairs, in order. */
    int64_t *first = (int64_t *)calloc((size_t)(2 * experts + 1), sizeof(int64_t));
    int64_t *slot = (int64_t *)malloc((size_t)pairs * sizeof(int64_t)); /* pair -> sorted */
    if (!first || !slot) {
        free(first);
        free(slot);
        return -1;
    }
    int64_t *used = first + experts + 1, n_used = 0;
    for (int64_t p = 0; p < pairs; p++) first[chosen[p] + 1]++;
    for (int64_t e = 0; e < experts; e++) {
        if (first[e + 1]) used[n_used++] = e;
        first[e + 1] += first[e];
    }
    for (int64_t p = 0; p < pairs; p++) slot[p] = first[chosen[p]]++; /* first[e] moves on */
    for (int64_t e = experts; e > 0; e--) first[e] = first[e - 1];      /* and back */
    first[0] = 0;
    int64_t widest = h > inter ? h : inter;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *wide = (float *)malloc((size_t)widest * sizeof(float));
        failed = wide == NULL;
        const uint8_t *values, *scales;
#pragma omp for schedule(static)
        for (int64_t p = 0; p < pairs; p++)
            memcpy(rows + slot[p] * h, x + (p / k) * h, (size_t)h * sizeof(float));
        /* Units of (used expert, output row). */
#pragma omp for schedule(static)
        for (int64_t u = 0; u < n_used * 2 * inter; u++) {
            int64_t e = used[u / (2 * inter)], o = u % (2 * inter), n = first[e + 1] - first[e];
            if (!wide) continue;
            expert_row(w13, format, e, o, &values, &scales);
            one_row(rows + first[e] * h, n, h, values, scales, format, wide,
                    gate_up + first[e] * 2 * inter + o, 2 * inter);
        }
#pragma omp for schedule(static)
        for (int64_t u = 0; u < pairs * inter; u++) {
            int64_t pair = u / inter, i = u % inter;
            float g = gate_up[pair * 2 * inter + i], up = gate_up[pair * 2 * inter + inter + i];
            g = g < limit ? g : limit;
            up = up < -limit ? -limit : (up > limit ? limit : up);
            act[u] = g / (1.0f + expf(-g)) * up;
        }
#pragma omp for schedule(static)
        for (int64_t u = 0; u < n_used * h; u++) {
            int64_t e = used[u / h], o = u % h, n = first[e + 1] - first[e];
            if (!wide) continue;
            expert_row(w2, format, e, o, &values, &scales);
            one_row(act + first[e] * inter, n, inter, values, scales, format, wide,
                    down + first[e] * h + o, h);
        }
#pragma omp for schedule(static)
        for (int64_t u = 0; u < t * h; u++) {
            int64_t token = u / h, o = u % h;
            float sum = 0.0f;
            for (int64_t j = 0; j < k; j++)
                sum += weights[token * k + j] * down[slot[token * k + j] * h + o];
            out[u] = sum;
        }
        free(wide);
    }
    free(first);
    free(slot);
    return failed ? -1 : 0;
}
