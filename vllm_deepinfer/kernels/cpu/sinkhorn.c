/* Sinkhorn normalisation of hyper-connections' copy-to-copy mix, in place: comb [T, n, n]
 * (fp32, contiguous, already softmaxed) has its columns normalised, then `iters - 1`
 * times its rows and its columns: x / (sum + eps), in the order the torch twin
 * (kernels/sinkhorn.py: sinkhorn_torch) runs. Each matrix is independent of the others,
 * so a row's result does not depend on the batch.
 *
 * Matrices of up to MAX_SIDE x MAX_SIDE run LANES at a time, one per vector lane (the
 * divisions were most of the time one at a time).
 *
 * Why C: the loop is 20 steps of small reductions. Inside vLLM's compiled graph Inductor
 * unrolls it into one generated kernel whose compile dominates the model's; eager, it is
 * 80 aten calls per sublayer boundary. As one opaque op it costs neither. */

#include <stdint.h>

/* Each line of m (rows: lines n apart, entries 1 apart; columns: the other way round)
 * divided by its sum plus eps. */
static void normalise(float *m, int64_t n, float eps, int64_t line, int64_t entry) {
    for (int64_t i = 0; i < n; i++) {
        float *first = m + i * line, sum = 0.0f;
        for (int64_t j = 0; j < n; j++) sum += first[j * entry];
        sum += eps;
        for (int64_t j = 0; j < n; j++) first[j * entry] /= sum;
    }
}

/* LANES matrices side by side (entry e of lane l at e * LANES + l), so that each step's
 * sums and divisions run on whole vectors across the matrices; each lane does exactly
 * the scalar steps above, in their order, so the bits are the same. */
#define LANES 16
#define MAX_SIDE 8 /* wider mixes take the scalar loop */

static void normalise_lanes(float *m, int64_t n, float eps, int64_t line, int64_t entry) {
    for (int64_t i = 0; i < n; i++) {
        float sum[LANES];
        for (int l = 0; l < LANES; l++) sum[l] = 0.0f;
        for (int64_t j = 0; j < n; j++) {
            const float *e = m + (i * line + j * entry) * LANES;
            for (int l = 0; l < LANES; l++) sum[l] += e[l];
        }
        for (int l = 0; l < LANES; l++) sum[l] += eps;
        for (int64_t j = 0; j < n; j++) {
            float *e = m + (i * line + j * entry) * LANES;
            for (int l = 0; l < LANES; l++) e[l] /= sum[l];
        }
    }
}

static void sinkhorn_block(float *comb, int64_t count, int64_t n, int iters, float eps) {
    float lanes[MAX_SIDE * MAX_SIDE * LANES];
    int64_t size = n * n;
    for (int64_t e = 0; e < size; e++)
        for (int64_t l = 0; l < LANES; l++)
            lanes[e * LANES + l] = l < count ? comb[l * size + e] : 1.0f; /* unused lanes */
    normalise_lanes(lanes, n, eps, 1, n); /* columns */
    for (int step = 1; step < iters; step++) {
        normalise_lanes(lanes, n, eps, n, 1); /* rows */
        normalise_lanes(lanes, n, eps, 1, n);
    }
    for (int64_t e = 0; e < size; e++)
        for (int64_t l = 0; l < count; l++) comb[l * size + e] = lanes[e * LANES + l];
}

void sinkhorn(float *comb, int64_t t, int64_t n, int iters, float eps, int threads) {
    if (n <= MAX_SIDE && t >= LANES / 2) { /* fewer: a block's unused lanes cost more */
        int64_t blocks = (t + LANES - 1) / LANES;
#pragma omp parallel for num_threads(threads) schedule(static) if (blocks > 4)
        for (int64_t b = 0; b < blocks; b++) {
            int64_t count = t - b * LANES < LANES ? t - b * LANES : LANES;
            sinkhorn_block(comb + b * LANES * n * n, count, n, iters, eps);
        }
        return;
    }
#pragma omp parallel for num_threads(threads) schedule(static) if (t > 64)
    for (int64_t k = 0; k < t; k++) {
        float *m = comb + k * n * n;
        normalise(m, n, eps, 1, n); /* columns */
        for (int step = 1; step < iters; step++) {
            normalise(m, n, eps, n, 1); /* rows */
            normalise(m, n, eps, 1, n);
        }
    }
}
