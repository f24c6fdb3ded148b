/* The sampler's last stage in one pass per row (forklift/sampling/sampler.py, sample):
 * the token (the first maximum of the logits for a greedy row, of logits / temperature plus
 * seeded Gumbel noise for a sampled one) and, where asked, its logprob under
 * log_softmax(logits / temperature) and its rank. As PyTorch operators this is a dozen
 * passes over [rows, vocab] temporaries; here the noise is made where it is used.
 *
 * The logarithms and the exponential are polynomials written for the compiler to vectorise
 * (libm's calls are not): within a few float ulps of libm, which can decide a draw only
 * where two tokens' noisy scores tie to that precision. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "hashed_noise.h"

#define CHUNK 1024 /* scores kept per pass: the first maximum is searched in this buffer */

static inline float bits_as_float(uint32_t bits) {
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

static inline uint32_t float_bits(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    return bits;
}

/* log(x) for a normal x > 0: x = 2^e m with m in [sqrt(1/2), sqrt(2)), and
 * log(m) = 2 atanh(s) with s = (m - 1) / (m + 1), |s| < 0.172: the odd series to s^9
 * leaves a relative error under 3e-9. */
static inline float positive_log(float x) {
    const uint32_t bits = float_bits(x);
    const int32_t e = (int32_t)(bits - 0x3f3504f3u) >> 23; /* 0x3f3504f3: sqrt(1/2) */
    const float m = bits_as_float(bits - ((uint32_t)e << 23));
    const float s = (m - 1.0f) / (m + 1.0f);
    const float s2 = s * s;
    const float series =
        s * (2.0f + s2 * (2.0f / 3 + s2 * (2.0f / 5 + s2 * (2.0f / 7 + s2 * (2.0f / 9)))));
    /* ln 2 split so that e * hi is exact. */
    return (float)e * 0.693145751953125f + (series + (float)e * 1.428606765330187e-6f);
}

/* max(x, floor) for a non-NaN x, as a bit select: GCC does not vectorise a loop around
 * the plain comparison's select (it keeps NaN's ordering rules). */
static inline float at_least(float x, float floor) {
    const uint32_t keep = 0u - (uint32_t)(x > floor);
    return bits_as_float((float_bits(x) & keep) | (float_bits(floor) & ~keep));
}

/* exp(x) for x <= 0 (-inf and anything below -87 give about 1e-38, nothing in a sum of at
 * least 1): x = n ln 2 + r with |r| <= ln 2 / 2, exp(r) by its Taylor series to r^7. */
static inline float nonpositive_exp(float x) {
    x = at_least(x, -87.0f);
    /* n = round(x / ln 2) by adding and removing 1.5 * 2^23 (floorf does not vectorise). */
    const float n = (x * 1.4426950408889634f + 12582912.0f) - 12582912.0f;
    const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-6f;
    const float p =
        1.0f +
        r * (1.0f +
             r * (0.5f +
                  r * (1.0f / 6 +
                       r * (1.0f / 24 + r * (1.0f / 120 + r * (1.0f / 720 + r * (1.0f / 5040)))))));
    return p * bits_as_float((uint32_t)((int32_t)n + 127) << 23);
}

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
                const float score = p - positive_log(-positive_log(scores[i]));
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
        for (int64_t i = 0; i < n; i++) chunk_total += nonpositive_exp(scores[i] - row_max);
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
