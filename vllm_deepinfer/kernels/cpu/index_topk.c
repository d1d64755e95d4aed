/* The lightning indexer's selection, from the scores index_scores gave (one row per
 * query token, one column per compressed group of its request):
 *
 *   - index_topk: each row's best k groups among those it may choose (below its visible
 *     count and, where given, inside its candidate blocks), written at the row's token;
 *   - candidate_blocks: the candidate source's mask of the positions inside each row's
 *     best blocks (block score: the highest visible score in it; the block holding the
 *     newest visible position always qualifies).
 *
 * Both rank as the torch twins do (model/deepseek_v41/indexer.py: topk_groups and
 * candidate_blocks, through ops.stable_topk), to the same indices in the same order:
 * score descending, ties to the lower index (a stable descending sort); a NaN ranks as
 * -inf and +-inf as the largest / least finite float (torch.nan_to_num), and a group a
 * row may not choose as -inf (so, as the least finite float).
 *
 * Why C: the twins are a dozen aten calls per request group (masks, nan_to_num, a sort
 * or topk, gathers, the scatter into the step's rows), most of the indexer's time in a
 * decode step. Here a row keeps a heap of its k best while reading its scores once.
 * Each row is computed alone; rows are split across `threads` OpenMP threads. */

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

typedef struct {
    float key;
    int64_t index;
} ranked;

/* The value a score ranks by (torch.nan_to_num with nan = -inf). */
static inline float rank_key(float score) {
    if (isnan(score)) return -INFINITY;
    if (isinf(score)) return score > 0 ? FLT_MAX : -FLT_MAX;
    return score;
}

/* Whether a ranks below b: a lower key, or the same key at a higher index. */
static inline int below(ranked a, ranked b) {
    return a.key < b.key || (a.key == b.key && a.index > b.index);
}

/* Restores the heap (its lowest-ranked entry at the root) below entry i. */
static void sift_down(ranked *heap, int64_t n, int64_t i) {
    for (;;) {
        int64_t low = i, left = 2 * i + 1, right = left + 1;
        if (left < n && below(heap[left], heap[low])) low = left;
        if (right < n && below(heap[right], heap[low])) low = right;
        if (low == i) return;
        ranked t = heap[i];
        heap[i] = heap[low];
        heap[low] = t;
        i = low;
    }
}

static void sift_up(ranked *heap, int64_t i) {
    while (i > 0) {
        int64_t parent = (i - 1) / 2;
        if (!below(heap[i], heap[parent])) return;
        ranked t = heap[i];
        heap[i] = heap[parent];
        heap[parent] = t;
        i = parent;
    }
}

/* Offers entry c to a heap of at most k entries holding n. */
static inline void offer(ranked *heap, int64_t *n, int64_t k, ranked c) {
    if (*n < k) {
        heap[*n] = c;
        sift_up(heap, (*n)++);
    } else if (below(heap[0], c)) {
        heap[0] = c;
        sift_down(heap, k, 0);
    }
}

/* The heap's n entries in rank order, best first, in place. */
static void rank_order(ranked *heap, int64_t n) {
    for (int64_t end = n - 1; end > 0; end--) {
        ranked t = heap[0];
        heap[0] = heap[end];
        heap[end] = t;
        sift_down(heap, end, 0);
    }
}

/* Whether row r may choose group g. */
static inline int allowed(int64_t g, int64_t visible, const uint8_t *candidates) {
    return g < visible && (candidates == NULL || candidates[g]);
}

/* scores [rows, groups] fp32; visible [rows]; candidates [rows, groups] or NULL; row r's
 * min(k, groups) best go to chosen / valid [tokens, width] at row token[r] (skipped where
 * token[r] < 0), whether each is allowed in `valid`. Returns 0, -1 if a buffer could not be
 * allocated. */
int index_topk(const float *scores, int64_t rows, int64_t groups, const int64_t *visible,
               const uint8_t *candidates, int64_t k, const int64_t *token, int64_t *chosen,
               uint8_t *valid, int64_t width, int threads) {
    int64_t kept = k < groups ? k : groups;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        ranked *heap = (ranked *)malloc((size_t)(kept > 0 ? kept : 1) * sizeof(ranked));
        failed = heap == NULL;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            if (!heap || token[r] < 0) continue;
            const float *row = scores + r * groups;
            const uint8_t *cand = candidates ? candidates + r * groups : NULL;
            int64_t n = 0;
            for (int64_t g = 0; g < groups; g++) {
                ranked c = {allowed(g, visible[r], cand) ? rank_key(row[g]) : -FLT_MAX, g};
                offer(heap, &n, kept, c);
            }
            rank_order(heap, n);
            for (int64_t j = 0; j < n; j++) {
                chosen[token[r] * width + j] = heap[j].index;
                valid[token[r] * width + j] = (uint8_t)allowed(heap[j].index, visible[r], cand);
            }
        }
        free(heap);
    }
    return failed ? -1 : 0;
}

/* scores [rows, groups] fp32; visible [rows]; keep [rows, groups] gets whether each
 * position lies inside one of the row's best min(top_blocks, blocks) blocks of
 * block_size positions (a block scored -inf or NaN never counts) and is visible.
 * Returns 0, -1 if a buffer could not be allocated. */
int candidate_blocks(const float *scores, int64_t rows, int64_t groups, const int64_t *visible,
                     int64_t block_size, int64_t top_blocks, uint8_t *keep, int threads) {
    int64_t blocks = (groups + block_size - 1) / block_size;
    int64_t kept = top_blocks < blocks ? top_blocks : blocks;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *block_score = (float *)malloc((size_t)(blocks > 0 ? blocks : 1) * sizeof(float));
        uint8_t *chosen = (uint8_t *)malloc((size_t)(blocks > 0 ? blocks : 1));
        ranked *heap = (ranked *)malloc((size_t)(kept > 0 ? kept : 1) * sizeof(ranked));
        failed = !block_score || !chosen || !heap;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            if (failed) continue;
            const float *row = scores + r * groups;
            int64_t seen = visible[r];
            for (int64_t b = 0; b < blocks; b++) {
                /* amax over the block: NaN if any visible score is NaN, -inf if none. */
                float best = -INFINITY;
                int nan = 0;
                int64_t end = (b + 1) * block_size < groups ? (b + 1) * block_size : groups;
                for (int64_t g = b * block_size; g < end && g < seen; g++) {
                    if (isnan(row[g]))
                        nan = 1;
                    else if (row[g] > best)
                        best = row[g];
                }
                block_score[b] = nan ? NAN : best;
                chosen[b] = 0;
            }
            if (blocks > 0) block_score[(seen > 0 ? seen - 1 : 0) / block_size] = INFINITY;
            int64_t n = 0;
            for (int64_t b = 0; b < blocks; b++) {
                ranked c = {rank_key(block_score[b]), b};
                offer(heap, &n, kept, c);
            }
            for (int64_t j = 0; j < n; j++)
                chosen[heap[j].index] = block_score[heap[j].index] > -INFINITY;
            for (int64_t g = 0; g < groups; g++)
                keep[r * groups + g] = g < seen && chosen[g / block_size];
        }
        free(block_score);
        free(chosen);
        free(heap);
    }
    return failed ? -1 : 0;
}
