/* The sampler's seeded noise for one token (forklift/sampling/sampler.py, hashed_uniform):
 * uniform(0, 1) from a stateless hash of (seed, step, token id), in 64-bit wrapping
 * arithmetic with splitmix64's finaliser, from the top 24 bits. */
#ifndef FORKLIFT_HASHED_NOISE_H
#define FORKLIFT_HASHED_NOISE_H

#include <stdint.h>

/* What a row's draws share: its seed and the index of the token being sampled. */
static inline uint64_t hashed_noise_base(int64_t seed, int64_t step) {
    return ((uint64_t)seed * 0x2545F4914F6CDD1DULL) ^ ((uint64_t)step * 0x9E3779B97F4A7C15ULL);
}

static inline float hashed_noise_at(uint64_t base, uint64_t token) {
    /* (2^24 - 0.5) / 2^24 rounds to 1.0 in float32, whose Gumbel noise is +inf: keep below. */
    const float top = 1.0f - 1.0f / 16777216.0f;
    uint64_t x = base + token * 0x632BE59BD9B4E019ULL;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
    x ^= x >> 31;
    const float u = ((float)(x >> 40) + 0.5f) / 16777216.0f;
    return u < top ? u : top;
}

#endif
