/* The dense bf16 matmul on AVX512-BF16 dot products, where the CPU has no AMX tiles (AMD's
 * Zen 4): each 64-byte row of a packed tile (dense_matmul.h) is one `vdpbf16ps` operand,
 * lane c holding output c's weights for an input pair, against that pair of a row's
 * activations broadcast. Each output of each row sums its pairs in one fp32 lane, in input
 * order, whatever rows share the pass: a row's result never depends on the rows beside it.
 * Included where isa/isa.h sets FORKLIFT_DENSE_NATIVE without FORKLIFT_DENSE_TILES. */
#ifndef FORKLIFT_DENSE_MATMUL_DOTS_H
#define FORKLIFT_DENSE_MATMUL_DOTS_H

/* Rows a pass carries: two accumulators each (the pair's 32 outputs), sixteen registers. */
#define DENSE_DOT_ROWS 8

/* Weight tiles ahead of the one multiplied that a pass fetches (the first pass of a pair
 * reads them from memory; later passes find them in L2). */
#define DENSE_DOT_PREFETCH_TILES 4

/* Outputs 32 j .. 32 j + 31 (blocks `first`, `second`, k_tiles tiles each) for `rows` rows of
 * x (bf16, `stride` apart): acc[2 r + c] holds row r's sums of block c. */
static inline __attribute__((always_inline)) void dense_dot_pass(
    const uint16_t *first, const uint16_t *second, int64_t k_tiles, const uint16_t *x,
    int64_t stride, int rows, int fetch, __m512 acc[2 * DENSE_DOT_ROWS]) {
    for (int r = 0; r < 2 * rows; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t t = 0; t < k_tiles; t++) {
        if (fetch)
            dense_prefetch_pair(first, second, t, DENSE_DOT_PREFETCH_TILES, PREFETCH_LOCALITY);
        const uint16_t *w0 = first + t * 512, *w1 = second + t * 512;
        const uint16_t *xt = x + 32 * t;
        for (int i = 0; i < 16; i++) {
            const __m512bh a = (__m512bh)_mm512_loadu_si512(w0 + 32 * i);
            const __m512bh b = (__m512bh)_mm512_loadu_si512(w1 + 32 * i);
            for (int r = 0; r < rows; r++) {
                int32_t pair;
                memcpy(&pair, xt + r * stride + 2 * i, sizeof(pair));
                const __m512bh xr = (__m512bh)_mm512_set1_epi32(pair);
                acc[2 * r] = _mm512_dpbf16_ps(acc[2 * r], a, xr);
                acc[2 * r + 1] = _mm512_dpbf16_ps(acc[2 * r + 1], b, xr);
            }
        }
    }
}

/* out [rows, n] = x [rows, k] @ W.T for packed W (n, k its real sizes). `xb`: scratch of
 * dense_scratch_elements(rows, k) bf16. Pairs of output blocks are split among the threads;
 * each pair's weights come from memory for its first pass of rows and from L2 for the rest. */
static inline void dense_matmul_rows(const uint16_t *packed, int64_t n, int64_t k,
                                     const float *x, int64_t rows, uint16_t *xb, float *out,
                                     int num_threads) {
    const int64_t k_padded = (k + 31) / 32 * 32, k_tiles = k_padded / 32;
    const int64_t pairs = (n + 31) / 32;
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) dense_round_row(x, r, rows, k, k_padded, xb);
        int64_t begin, end;
        dense_thread_pairs(pairs, &begin, &end);
        for (int64_t j = begin; j < end; j++) {
            const uint16_t *first = packed + 2 * j * k_tiles * 512;
            const uint16_t *second = first + k_tiles * 512;
            const int64_t col = 32 * j;
            __mmask16 lanes[2];
            dense_pair_lanes(n, col, lanes);
            for (int64_t r0 = 0; r0 < rows; r0 += DENSE_DOT_ROWS) {
                const int pass = rows - r0 < DENSE_DOT_ROWS ? (int)(rows - r0) : DENSE_DOT_ROWS;
                const uint16_t *xp = xb + r0 * k_padded;
                const int fetch = r0 == 0;
                __m512 acc[2 * DENSE_DOT_ROWS];
                /* Each row count its own copy, so the accumulators stay in registers. */
                switch (pass) {
#define DENSE_DOT_CASE(count)                                                                \
    case count: dense_dot_pass(first, second, k_tiles, xp, k_padded, count, fetch, acc); break;
                    DENSE_DOT_CASE(1)
                    DENSE_DOT_CASE(2)
                    DENSE_DOT_CASE(3)
                    DENSE_DOT_CASE(4)
                    DENSE_DOT_CASE(5)
                    DENSE_DOT_CASE(6)
                    DENSE_DOT_CASE(7)
                    default: dense_dot_pass(first, second, k_tiles, xp, k_padded,
                                            DENSE_DOT_ROWS, fetch, acc);
#undef DENSE_DOT_CASE
                }
                for (int r = 0; r < pass; r++)
                    for (int c = 0; c < 2; c++)
                        _mm512_mask_storeu_ps(out + (r0 + r) * n + col + 16 * c, lanes[c],
                                              acc[2 * r + c]);
            }
        }
    }
}

/* No tile state to ask for: the dot products run wherever the build does. */
static inline int dense_tiles_available(void) { return 1; }

#endif
