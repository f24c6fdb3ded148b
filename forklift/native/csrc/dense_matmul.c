/* The dense bf16 matmul of dense_matmul.h as exported calls (tests, benchmarks, and the
 * check whether this CPU and kernel allow the tiles at all). */
#include "dense_matmul.h"

int forklift_dense_tiles_available(void) { return dense_tiles_available(); }

/* out [rows, n] fp32 = x [rows, k] fp32 (rounded to bf16) @ W.T, W packed as the header
 * says. Returns 0, 1 when scratch memory ran out, 2 where no dense kernel is compiled in. */
int forklift_dense_matmul(const float *x, int64_t rows, int64_t k, const uint16_t *packed,
                          int64_t n, float *out, int num_threads) {
#if defined(FORKLIFT_DENSE_NATIVE)
    uint16_t *xb = malloc(sizeof(uint16_t) * (size_t)dense_scratch_elements(rows, k));
    if (xb == NULL) return 1;
    dense_matmul_rows(packed, n, k, x, rows, xb, out, num_threads);
    free(xb);
    return 0;
#else
    (void)x, (void)rows, (void)k, (void)packed, (void)n, (void)out, (void)num_threads;
    return 2;
#endif
}
