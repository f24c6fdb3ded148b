/* The sampler's last stage in one pass per row (forklift/sampling/sampler.py, sample):
 * the token (the first maximum of the logits for a greedy row, of logits / temperature plus
 * seeded Gumbel noise for a sampled one) and, where asked, its logprob under
 * log_softmax(logits / temperature) and its rank. As PyTorch operators this is a dozen
 * passes over [rows, vocab] temporaries; here the noise is made where it is used.
 *
 * The logarithms and the exponential are fast_math.h's polynomials: within a few float ulps
 * of libm, which can decide a draw only where two tokens' noisy scores tie that closely. */
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>

#include "fast_math.h"
#include "hashed_noise.h"

#define CHUNK 1024 /* scores kept per pass: the first maximum is searched in this buffer */

/* The first index in [0, n) holding `value`, which is there. */
static inline int64_t first_index_of(const float *values, int64_t n, float value) {
    int64_t i = 0;
    while (i < n - 1 && values[i] != value) i++;
    return i;
}

static void sample_row(const float *logits, int64_t vocab, float temperature, uint64_t base,
                       int64_t *token, float *logprob, int64_t *rank) {
    const int sampled = temperature > 0.0f;
    float scores[CHUNK];
    float best = -INFINITY, row_max = -INFINITY;
    int64_t best_at = 0;
    for (int64_t start = 0; start < vocab; start += CHUNK) {
        const int64_t n = vocab - start < CHUNK ? vocab - start : CHUNK;
        const float *x = logits + start;
        float chunk_best = -INFINITY, chunk_max = -INFINITY;
        const float *candidates = x;
        if (sampled) {
            /* Two loops: the compiler vectorises each, not the two as one. */
#pragma omp simd
            for (int64_t i = 0; i < n; i++) scores[i] = hashed_noise_at(base, (uint64_t)(start + i));
#pragma omp simd reduction(max : chunk_best, chunk_max)
            for (int64_t i = 0; i < n; i++) {
                const float p = x[i] / temperature;
                const float score = p - log_positive(-log_positive(scores[i]));
                scores[i] = score;
                chunk_max = p > chunk_max ? p : chunk_max;
                chunk_best = score > chunk_best ? score : chunk_best;
            }
            candidates = scores;
        } else {
#pragma omp simd reduction(max : chunk_best)
            for (int64_t i = 0; i < n; i++) chunk_best = x[i] > chunk_best ? x[i] : chunk_best;
            chunk_max = chunk_best;
        }
        /* An OpenMP max reduction may start from -FLT_MAX rather than -inf (clang): a
         * chunk whose values are all -inf must still read as -inf. */
        if (chunk_best == -FLT_MAX) chunk_best = -INFINITY;
        if (chunk_max == -FLT_MAX) chunk_max = -INFINITY;
        row_max = chunk_max > row_max ? chunk_max : row_max;
        /* Strictly greater: a later chunk's tie does not displace the first maximum. */
        if (start == 0 || chunk_best > best) {
            best = chunk_best;
            best_at = start + first_index_of(candidates, n, chunk_best);
        }
    }
    *token = best_at;
    if (logprob == NULL) return;
    const float chosen = sampled ? logits[best_at] / temperature : logits[best_at];
    const float divisor = sampled ? temperature : 1.0f; /* x / 1 is x exactly */
    double total = 0.0; /* of chunks' float sums: 49k terms in one float drift by 1e-4 */
    int64_t above = 0;
    for (int64_t start = 0; start < vocab; start += CHUNK) {
        const int64_t n = vocab - start < CHUNK ? vocab - start : CHUNK;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) scores[i] = logits[start + i] / divisor;
        float chunk_total = 0.0f;
        int32_t chunk_above = 0;
#pragma omp simd reduction(+ : chunk_total)
        for (int64_t i = 0; i < n; i++) chunk_total += exp_nonpositive(scores[i] - row_max);
#pragma omp simd reduction(+ : chunk_above)
        for (int64_t i = 0; i < n; i++) chunk_above += scores[i] > chosen ? 1 : 0;
        total += chunk_total;
        above += chunk_above;
    }
    *logprob = (float)((double)(chosen - row_max) - log(total));
    *rank = above + 1;
}

/* logits [rows, vocab] float32; temperature <= 0 marks a greedy row. logprobs and ranks
 * may be NULL: tokens only. */
void forklift_seeded_sample(const float *logits, int64_t rows, int64_t vocab,
                            const float *temperature, const int64_t *seeds,
                            const int64_t *steps, int64_t *tokens, float *logprobs,
                            int64_t *ranks, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows * vocab > 65536)
    for (int64_t r = 0; r < rows; r++) {
        sample_row(logits + r * vocab, vocab, temperature[r], hashed_noise_base(seeds[r], steps[r]),
                   tokens + r, logprobs == NULL ? NULL : logprobs + r,
                   ranks == NULL ? NULL : ranks + r);
    }
}
