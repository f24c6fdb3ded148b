/* The dense bf16 matmul on AMX-BF16 tiles (dense_matmul.h has the packed layout): 2 x 2
 * blocks of tile products, the rows rounded to bf16 by AVX512-BF16 first. Included where
 * isa/isa.h sets FORKLIFT_DENSE_TILES. */
#ifndef FORKLIFT_DENSE_MATMUL_AMX_H
#define FORKLIFT_DENSE_MATMUL_AMX_H

/* Tiles 0-3: fp32 sums (rows 16 m .. of the pair, outputs 16 c .. of the pair: tile 2 m + c);
 * 4, 5: activations of the pair's two row tiles; 6, 7: the two output blocks' weight tiles.
 * Each loaded tile serves two products (the 2 x 2 blocking that keeps the tile unit busy).
 * All tiles 16 rows of 64 bytes. */
static inline void dense_configure(void) {
    AmxTileConfig config = {.palette = 1};
    for (int t = 0; t < 8; t++) {
        config.colsb[t] = 64;
        config.rows[t] = 16;
    }
    _tile_loadconfig(&config);
}

/* Weight tiles ahead of the ones multiplied that a pass of two row tiles fetches into L2 as
 * it goes: such a pass has enough products per weight byte to hide the fetch (32 and 64 rows
 * ran 9% and 5% faster over the default model's layers); one row tile waits on memory
 * either way. */
#define DENSE_PREFETCH_TILES 8

/* Two blocks of 16 outputs (their tiles `first`, `second`, k_tiles each) against one or two
 * tiles of 16 activation rows (x: bf16 rows of `stride` elements); the sums of tile
 * 2 m + c stored straight to `out` (rows `out_stride` floats apart: tile 2 m + c's first
 * sum at out[16 m out_stride + 16 c]) where it is given, else into sums[2 m + c] ([16][16])
 * for the caller to copy. `fetch`: prefetch the weights ahead (their first pass). */
static inline __attribute__((always_inline)) void dense_pair(
    const uint16_t *first, const uint16_t *second, int64_t k_tiles, const uint16_t *x,
    int64_t stride, int m_tiles, float (*sums)[256], float *out, int64_t out_stride,
    int fetch) {
    const size_t row_bytes = (size_t)stride * 2;
    _tile_zero(0);
    _tile_zero(1);
    if (m_tiles > 1) {
        _tile_zero(2);
        _tile_zero(3);
    }
    for (int64_t t = 0; t < k_tiles; t++) {
        if (fetch) dense_prefetch_pair(first, second, t, DENSE_PREFETCH_TILES, 2);
        _tile_loadd(6, first + t * 512, 64);
        _tile_loadd(4, x + 32 * t, row_bytes);
        _tile_dpbf16ps(0, 4, 6);
        if (m_tiles > 1) _tile_loadd(5, x + 16 * stride + 32 * t, row_bytes);
        _tile_loadd(7, second + t * 512, 64);
        if (m_tiles > 1) _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (m_tiles > 1) _tile_dpbf16ps(3, 5, 7);
    }
    if (out != NULL) {
        const size_t out_bytes = (size_t)out_stride * sizeof(float);
        _tile_stored(0, out, out_bytes);
        _tile_stored(1, out + 16, out_bytes);
        if (m_tiles > 1) {
            _tile_stored(2, out + 16 * out_stride, out_bytes);
            _tile_stored(3, out + 16 * out_stride + 16, out_bytes);
        }
        return;
    }
    _tile_stored(0, sums[0], 64);
    _tile_stored(1, sums[1], 64);
    if (m_tiles > 1) {
        _tile_stored(2, sums[2], 64);
        _tile_stored(3, sums[3], 64);
    }
}

/* out [rows, n] = x [rows, k] @ W.T for packed W (n, k its real sizes). `xb`: scratch of
 * dense_scratch_elements(rows, k) bf16. Pairs of output blocks are split among the threads;
 * each pair's weights come from memory for the first 32 rows and from L2 for the rest. */
static inline void dense_matmul_rows(const uint16_t *packed, int64_t n, int64_t k,
                                     const float *x, int64_t rows, uint16_t *xb, float *out,
                                     int num_threads) {
    const int64_t k_padded = (k + 31) / 32 * 32, k_tiles = k_padded / 32;
    const int64_t pairs = (n + 31) / 32;
    const int64_t padded_rows = (rows + 15) / 16 * 16;
#pragma omp parallel num_threads(num_threads)
    {
        /* The rows are rounded on every thread (at 64 rows, on one they took a seventh of
         * an RL rollout's matmul time); the loop's barrier lets no product start early. */
#pragma omp for schedule(static)
        for (int64_t r = 0; r < padded_rows; r++) dense_round_row(x, r, rows, k, k_padded, xb);
        dense_configure();
        float sums[4][256] __attribute__((aligned(64)));
        int64_t begin, end;
        dense_thread_pairs(pairs, &begin, &end);
        for (int64_t j = begin; j < end; j++) {
            const uint16_t *first = packed + 2 * j * k_tiles * 512;
            const uint16_t *second = first + k_tiles * 512;
            const int64_t col = 32 * j;
            __mmask16 lanes[2];
            dense_pair_lanes(n, col, lanes);
            for (int64_t r0 = 0; r0 < rows; r0 += 32) {
                const int64_t pass_rows = rows - r0 < 32 ? rows - r0 : 32;
                const uint16_t *xp = xb + r0 * k_padded;
                /* Whole tiles of the output (all 32 outputs of the pair, every row of the
                 * tiles real) go straight from the tiles to its rows: copied through `sums`,
                 * a 730-token prefill's matmuls took 1.06x as long. */
                const int whole = lanes[1] == 0xffff && (pass_rows == 32 || pass_rows == 16);
                float *direct = whole ? out + r0 * n + col : NULL;
                if (pass_rows > 16)
                    dense_pair(first, second, k_tiles, xp, k_padded, 2, sums, direct, n, r0 == 0);
                else
                    dense_pair(first, second, k_tiles, xp, k_padded, 1, sums, direct, n, 0);
                if (whole) continue;
                for (int64_t r = 0; r < pass_rows; r++)
                    for (int c = 0; c < 2; c++) {
                        const float *row = sums[2 * (r / 16) + c] + (r % 16) * 16;
                        _mm512_mask_storeu_ps(out + (r0 + r) * n + col + 16 * c, lanes[c],
                                              _mm512_load_ps(row));
                    }
            }
        }
        amx_tiles_release();
    }
}

/* 1 where the kernel grants this process the tile state. */
static inline int dense_tiles_available(void) { return amx_tiles_usable(); }

#endif
