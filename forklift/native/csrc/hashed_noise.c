/* The sampler's seeded noise (forklift/sampling/sampler.py, hashed_uniform) in one pass:
 * u[r, t] = uniform(0, 1) from a stateless hash of (seed r, step r, token t), the same bits
 * as the PyTorch expression (64-bit wrapping arithmetic, splitmix64's finaliser, the top 24
 * bits), without its dozen passes over [rows, vocab] int64 temporaries. */
#include <omp.h>
#include <stdint.h>

void forklift_hashed_uniform(const int64_t *seeds, const int64_t *steps, int64_t rows,
                             int64_t vocab, float *out, int num_threads) {
    const float top = 1.0f - 1.0f / 16777216.0f; /* below 1: see hashed_uniform */
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows * vocab > 65536)
    for (int64_t r = 0; r < rows; r++) {
        const uint64_t base = ((uint64_t)seeds[r] * 0x2545F4914F6CDD1DULL) ^
                              ((uint64_t)steps[r] * 0x9E3779B97F4A7C15ULL);
        float *row = out + r * vocab;
        for (int64_t t = 0; t < vocab; t++) {
            uint64_t x = base + (uint64_t)t * 0x632BE59BD9B4E019ULL;
            x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
            x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
            x ^= x >> 31;
            const float u = ((float)(x >> 40) + 0.5f) / 16777216.0f;
            row[t] = u < top ? u : top;
        }
    }
}
