/* Sinkhorn normalisation of hyper-connections' copy-to-copy mix, in place: comb [T, n, n]
 * (fp32, contiguous, already softmaxed) has its columns normalised, then `iters - 1`
 * times its rows and its columns: x / (sum + eps), in the order the torch twin
 * (kernels/sinkhorn.py: sinkhorn_torch) runs. Each matrix is independent of the others,
 * so a row's result does not depend on the batch.
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

void sinkhorn(float *comb, int64_t t, int64_t n, int iters, float eps, int threads) {
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
