/* Weight-only products for few activation rows (decode): y[m, o] = sum_k x[m, k] * W[o, k],
 * W read once as stored and widened in registers, never written out wide.
 *
 *   MXFP4: values [O, K/2] bytes, two e2m1 codes a byte (element 2j in the low nibble),
 *          scale [O, K/32] UE8M0 bytes.
 *   MXFP8: values [O, K] e4m3 bytes, scale [O/32, K/32] UE8M0 bytes.
 *   BF16:  values [O, K] bf16 (the head), no scale.
 *
 * x is fp32 [M, K] (row stride K), y fp32 [M, O] (row stride O). Row strides of values
 * and scale are given in bytes (an expert's slice of a stacked parameter is a view).
 *
 * Every weight is dequantized exactly (code value times its power of two, as
 * checkpoint/mx_formats.py decodes it), then each output is accumulated over K in 8-lane
 * chunks into four accumulators (chunk c of a 32-value block into accumulator c), summed
 * (a0 + a1) + (a2 + a3) and reduced lane by lane in a fixed order. That arithmetic does
 * not depend on M or on which rows run together, so an output row's value does not
 * depend on the batch. The torch twins (kernels/mx_matmul.py: dequantized_rows, then a
 * matmul; a plain matmul for bf16) are the reference in
 * tests/kernels/test_weight_gemv.py.
 *
 * Built once per machine with -march=native (kernels/cpu_build.py); the AVX2 + FMA path
 * runs wherever the compiler targets them (AVX-512 machines included), a scalar path of
 * the same arithmetic elsewhere. Rows are split across `threads` OpenMP threads. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define MX_AVX2 1
#else
#define MX_AVX2 0
#endif

#define BLOCK 32
#define PAIR 2 /* activation rows that share one dequantized block in registers */

enum format { MXFP8 = 0, MXFP4 = 1, BF16 = 2 };

/* 2**(b - 127) and 2**(b - 128) (MXFP4 codes are held doubled, as integers). */
static float ue8m0[256];
static float ue8m0_half[256];

int weight_gemv_simd(void) { return MX_AVX2; }

void weight_gemv_init(void) {
    for (int b = 0; b < 256; b++) {
        ue8m0[b] = ldexpf(1.0f, b - 127);
        ue8m0_half[b] = ldexpf(1.0f, b - 128);
    }
}

/* e2m1 code -> twice its value, an integer in [-12, 12]. */
static const int8_t E2M1_DOUBLED[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

#if MX_AVX2

static inline float lanes_sum(__m256 v) {
    /* Fixed order: (l0+l4, l1+l5, l2+l6, l3+l7), then pairs, then the last two. */
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

/* One 32-value MXFP4 block (16 bytes) as four scaled 8-lane vectors. */
static inline void mxfp4_block(const uint8_t *q, float factor, __m256 w[4]) {
    const __m128i lut = _mm_loadu_si128((const __m128i *)E2M1_DOUBLED);
    const __m128i nibble = _mm_set1_epi8(0x0F);
    __m128i bytes = _mm_loadu_si128((const __m128i *)q);
    __m128i lo = _mm_shuffle_epi8(lut, _mm_and_si128(bytes, nibble));
    __m128i hi = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble));
    __m128i first = _mm_unpacklo_epi8(lo, hi); /* elements 0..15 */
    __m128i second = _mm_unpackhi_epi8(lo, hi); /* elements 16..31 */
    __m256 f = _mm256_set1_ps(factor);
    w[0] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(first)), f);
    w[1] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(first, 8))), f);
    w[2] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(second)), f);
    w[3] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(second, 8))), f);
}

/* Eight e4m3 bytes as fp32: sign and the seven low bits moved into place give the value
 * times 2**-120 for normals and subnormals alike; 2**120 restores it, then the scale. */
static inline __m256 e4m3_eight(const uint8_t *q, __m256 factor) {
    __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)q));
    __m256i sign = _mm256_slli_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0x80)), 24);
    __m256i rest = _mm256_slli_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0x7F)), 20);
    __m256 raw = _mm256_castsi256_ps(_mm256_or_si256(sign, rest));
    return _mm256_mul_ps(_mm256_mul_ps(raw, _mm256_set1_ps(0x1p120f)), factor);
}

static inline void mxfp8_block(const uint8_t *q, float factor, __m256 w[4]) {
    __m256 f = _mm256_set1_ps(factor);
    for (int c = 0; c < 4; c++) w[c] = e4m3_eight(q + 8 * c, f);
}

/* bf16 is the top half of fp32. */
static inline void bf16_block(const uint8_t *q, __m256 w[4]) {
    for (int c = 0; c < 4; c++) {
        __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(q + 16 * c)));
        w[c] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    }
}

/* Block b of a row, widened. */
static inline void block(const uint8_t *values, const uint8_t *scales, int format, int64_t b,
                         __m256 w[4]) {
    if (format == MXFP4)
        mxfp4_block(values + b * 16, ue8m0_half[scales[b]], w);
    else if (format == MXFP8)
        mxfp8_block(values + b * BLOCK, ue8m0[scales[b]], w);
    else
        bf16_block(values + b * 2 * BLOCK, w);
}

/* Accumulate one block's four vectors against up to PAIR activation rows. */
static inline void accumulate(const __m256 w[4], const float *x, int64_t k, int rows,
                              __m256 acc[PAIR][4]) {
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < 4; c++)
            acc[r][c] = _mm256_fmadd_ps(w[c], _mm256_loadu_ps(x + r * k + 8 * c), acc[r][c]);
}

static inline float finish(__m256 acc[4]) {
    return lanes_sum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
}

/* Output row o for activation rows [0, m): each block dequantized once when m <= PAIR,
 * else once into `wide` (K floats, this thread's), then read per pair of rows. */
static void one_row(const float *x, int64_t m, int64_t k, const uint8_t *values,
                    const uint8_t *scales, int format, float *wide, float *y, int64_t ystride) {
    int64_t blocks = k / BLOCK;
    if (m > PAIR) {
        for (int64_t b = 0; b < blocks; b++) {
            __m256 w[4];
            block(values, scales, format, b, w);
            for (int c = 0; c < 4; c++) _mm256_storeu_ps(wide + b * BLOCK + 8 * c, w[c]);
        }
    }
    for (int64_t r0 = 0; r0 < m; r0 += PAIR) {
        int rows = (int)(m - r0 < PAIR ? m - r0 : PAIR);
        __m256 acc[PAIR][4];
        for (int r = 0; r < PAIR; r++)
            for (int c = 0; c < 4; c++) acc[r][c] = _mm256_setzero_ps();
        const float *xr = x + r0 * k;
        for (int64_t b = 0; b < blocks; b++) {
            __m256 w[4];
            if (m > PAIR) {
                for (int c = 0; c < 4; c++) w[c] = _mm256_loadu_ps(wide + b * BLOCK + 8 * c);
            } else {
                block(values, scales, format, b, w);
            }
            accumulate(w, xr + b * BLOCK, k, rows, acc);
        }
        for (int r = 0; r < rows; r++) y[(r0 + r) * ystride] = finish(acc[r]);
    }
}

#else /* the same arithmetic, one lane at a time */

static inline float e4m3_value(uint8_t byte) {
    union {
        uint32_t u;
        float f;
    } bits;
    bits.u = ((uint32_t)(byte & 0x80) << 24) | ((uint32_t)(byte & 0x7F) << 20);
    return bits.f * 0x1p120f;
}

static inline float bf16_value(const uint8_t *q) {
    union {
        uint32_t u;
        float f;
    } bits;
    bits.u = (uint32_t)(q[0] | (q[1] << 8)) << 16; /* little-endian, as torch stores it */
    return bits.f;
}

static void one_row(const float *x, int64_t m, int64_t k, const uint8_t *values,
                    const uint8_t *scales, int format, float *wide, float *y, int64_t ystride) {
    int64_t blocks = k / BLOCK;
    for (int64_t b = 0; b < blocks; b++)
        for (int j = 0; j < BLOCK; j++) {
            float *w = wide + b * BLOCK + j;
            if (format == MXFP4) {
                uint8_t byte = values[b * 16 + j / 2];
                int code = j % 2 ? byte >> 4 : byte & 0x0F;
                *w = (float)E2M1_DOUBLED[code] * ue8m0_half[scales[b]];
            } else if (format == MXFP8) {
                *w = e4m3_value(values[b * BLOCK + j]) * ue8m0[scales[b]];
            } else {
                *w = bf16_value(values + 2 * (b * BLOCK + j));
            }
        }
    for (int64_t r = 0; r < m; r++) {
        float acc[4][8] = {{0}};
        for (int64_t b = 0; b < blocks; b++)
            for (int c = 0; c < 4; c++)
                for (int l = 0; l < 8; l++) {
                    int64_t i = b * BLOCK + 8 * c + l;
                    acc[c][l] = fmaf(wide[i], x[r * k + i], acc[c][l]);
                }
        float lanes[8];
        for (int l = 0; l < 8; l++) lanes[l] = (acc[0][l] + acc[1][l]) + (acc[2][l] + acc[3][l]);
        float s[4];
        for (int l = 0; l < 4; l++) s[l] = lanes[l] + lanes[l + 4];
        y[r * ystride] = (s[0] + s[2]) + (s[1] + s[3]);
    }
}

#endif

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
            const uint8_t *scales = format == MXFP4   ? scale + o * scale_stride
                                    : format == MXFP8 ? scale + (o / BLOCK) * scale_stride
                                                      : NULL;
            one_row(x, m, k, values + o * values_stride, scales, format, wide, y + o, rows);
        }
        free(wide);
    }
    return failed ? -1 : 0;
}
