/* The quantized matmul on AMX-INT8 tiles from 16 activation rows (quant_matmul.h has the
 * layout): per block one tile product of the rows' codes by a pair of row groups' unpacked
 * codes (quant_matmul_avx512.h), scaled as the pairs' dot products are. */
#ifndef FORKLIFT_QUANT_MATMUL_AMX_H
#define FORKLIFT_QUANT_MATMUL_AMX_H

#define QUANT_TILE_ROWS 16
/* The fewest rows a tile of split rows takes (group_pair_split_tiles); eight take one tile
 * as paired rows. */
#define SPLIT_TILE_MIN_ROWS 9

/* Tile t of rows' scales (rows `tile_rows` t.. of x, tile_rows <= 16) transposed into the
 * t-th TileScales of `all` (each `blocks` * 16 entries long). */
static inline void transpose_tile_scales(const QuantizedRow *x, int64_t t, int64_t blocks,
                                         TileScales all, int tile_rows) {
    const int64_t first = t * blocks * QUANT_TILE_ROWS;
    for (int r = 0; r < tile_rows; r++) {
        const QuantizedRow row = x[t * tile_rows + r];
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t at = first + b * QUANT_TILE_ROWS + r;
            all.xd[at] = row.xd[b];
            all.xs[at] = row.xs[b];
            all.offset[at] = row.offset[b];
        }
    }
}

/* The tile shapes a matmul's rows take (quant_tiles_configure). */
enum { QUANT_TILES_INT8, QUANT_TILES_WIDE, QUANT_TILES_SPLIT };

/* Tiles 0, 1: a block's int32 sums (16 rows x 16 outputs), even and odd blocks; 2, 3: the
 * rows' codes of the block (16 x 32 bytes; wide rows, 16 x 64); 4, 5: the pair's unpacked
 * codes (8 x 64 bytes, vector c of unpack_pair_block as row c: the B operand's layout of
 * four inputs per output; against wide rows 16 x 64, store_pair_block's). Split rows (a q8
 * weight's wide rows, group_pair_split_tiles): 2 and 3 take the rows' high and low parts
 * (16 x 32 bytes each), 4 and 5 the even and odd blocks' signed codes (8 x 64), and 6, 7
 * the odd block's sums beside 0, 1 (the even block's high and low). */
static inline void quant_tiles_configure(int form, int tile_rows) {
    AmxTileConfig config = {.palette = 1};
    for (int t = 0; t < 2; t++) {
        config.colsb[t] = 64;
        config.rows[t] = (uint8_t)tile_rows;
        config.colsb[2 + t] = form == QUANT_TILES_WIDE ? 64 : 32;
        config.rows[2 + t] = (uint8_t)tile_rows;
        config.colsb[4 + t] = 64;
        config.rows[4 + t] = form == QUANT_TILES_WIDE ? 16 : 8;
        config.colsb[6 + t] = form == QUANT_TILES_SPLIT ? 64 : 0;
        config.rows[6 + t] = form == QUANT_TILES_SPLIT ? (uint8_t)tile_rows : 0;
    }
    _tile_loadconfig(&config);
}

/* Block b of q8 groups g and g + 1 as the split tiles read it: the codes signed, as the
 * file holds them (unpack_pair_block's order), 512 bytes at `dst`. */
static inline __attribute__((always_inline)) void store_signed_pair_block(
    const uint8_t *codes0, const uint8_t *codes1, int64_t b, uint8_t *dst) {
    __m512i w[8];
    fetch_pair_block(codes0, codes1, b, 0, w);
    for (int c = 0; c < 8; c++)
        _mm512_store_si512(dst + 64 * c, _mm512_xor_si512(w[c], _mm512_set1_epi8((char)0x80)));
}

/* The next pair of groups' codes, unpacked block by block during a tile's products
 * (group_pair_tiles, group_pair_split_tiles) into `to` as the tiles read them: the unpack's
 * loads then overlap the products and scaling instead of stalling the next pair's start
 * (from 32 rows a pair's unpack took about a quarter of its matmul). `to` NULL: none. */
typedef struct {
    const uint8_t *codes0, *codes1;
    uint8_t *to;
} NextPairUnpack;

static const NextPairUnpack NO_NEXT_PAIR = {NULL, NULL, NULL};

/* Block b's tile product into sum tile `sum` from the rows' and the codes' tiles (tile
 * numbers are the instruction's immediates: literals only). The empty asm orders the
 * stores of `packed` before its tile load, which the compiler does not see reading memory. */
#define QUANT_TILE_PRODUCT(sum, rows_tile, codes_tile, rows_codes, stride, packed)              \
    do {                                                                                        \
        __asm__ volatile("" ::: "memory");                                                      \
        _tile_zero(sum);                                                                        \
        _tile_loadd(rows_tile, rows_codes, stride);                                             \
        _tile_loadd(codes_tile, packed, 64);                                                    \
        _tile_dpbsud(sum, rows_tile, codes_tile);                                               \
    } while (0)

/* Sixteen activation rows against groups g and g + 1 on AMX-INT8 (tiles as
 * quant_tiles_configure sets them): one tile product per block (`tdpbsud`, the rows' signed
 * codes by the pair's unsigned ones) gives each row's sixteen int32 block sums, the integers
 * group_pair_tile's dot products sum, and each row's sums then go through scale_block_sums:
 * the result is group_pair_tile's bit for bit, with a third of its instructions per row.
 * Pipelined: block b's product runs while block b - 1's sums are stored and block b - 2's
 * are scaled, so no step waits on the one before it; the next pair's block b is unpacked
 * beside them when `next` says so. The rows' codes lie `stride` bytes apart; their scales
 * are `scales` (see TileScales). sums[r * 16 + i]. */
static inline __attribute__((always_inline)) void group_pair_tiles(
    const uint8_t *codes0, const uint8_t *codes1, const uint16_t *d0, const uint16_t *d1,
    const uint16_t *m0, const uint16_t *m1, int64_t blocks, const QuantizedRow *x,
    int64_t stride, TileScales scales, float *sums, int is_q4, int wide,
    const uint8_t *unpacked, int pairs, NextPairUnpack next) {
    /* Wide rows (quantize_wide_row): one product of 64 bytes a block, the same sums as the
     * dot products' (group_pair_tile). */
    const int64_t tile_bytes = wide ? 1024 : 512, row_bytes = wide ? 2 * QK : QK;
    uint8_t codes_tile[2][1024] __attribute__((aligned(64)));
    /* Slot b % 2 takes block b's sums one iteration after its product and is read the next:
     * by then the slot's previous block has been scaled. */
    int32_t block_sums[2][16 * QUANT_TILE_ROWS] __attribute__((aligned(64)));
    __m512 acc[QUANT_TILE_ROWS];
    for (int r = 0; r < QUANT_TILE_ROWS; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks + 2; b++) {
        if (b < blocks) {
            const uint8_t *tile = unpacked != NULL ? unpacked + b * tile_bytes : codes_tile[b & 1];
            if (unpacked == NULL)
                store_pair_block(codes0, codes1, b, is_q4, wide, codes_tile[b & 1]);
            if (b & 1)
                QUANT_TILE_PRODUCT(1, 3, 5, x[0].q + b * row_bytes, stride, tile);
            else
                QUANT_TILE_PRODUCT(0, 2, 4, x[0].q + b * row_bytes, stride, tile);
            if (next.to != NULL)
                store_pair_block(next.codes0, next.codes1, b, is_q4, wide,
                                 next.to + b * tile_bytes);
        }
        if (b >= 1 && b - 1 < blocks) {
            if ((b - 1) & 1)
                _tile_stored(1, block_sums[(b - 1) % 2], 64);
            else
                _tile_stored(0, block_sums[(b - 1) % 2], 64);
        }
        if (b >= 2) {
            const int64_t done = b - 2;
            const int32_t *done_sums = block_sums[done % 2];
            const __m512 wd = pair_scales(d0, d1, done);
            const __m512 wm = is_q4 ? pair_scales(m0, m1, done) : _mm512_setzero_ps();
            const int64_t at = done * QUANT_TILE_ROWS;
            if (pairs) /* rows 2 i and 2 i + 1: row i's high and low parts */
                for (int r = 0; r < QUANT_TILE_ROWS / 2; r++) {
                    const __m512i high = _mm512_load_si512(done_sums + 32 * r);
                    const __m512i low = _mm512_load_si512(done_sums + 32 * r + 16);
                    acc[r] = scale_block_sums(acc[r], join_high_low(high, low), wd, wm,
                                              scales.xd + at + 2 * r, scales.xs + at + 2 * r,
                                              scales.offset + at + 2 * r, 0);
                }
            else
                for (int r = 0; r < QUANT_TILE_ROWS; r++)
                    acc[r] = scale_block_sums(acc[r], _mm512_load_si512(done_sums + 16 * r), wd,
                                              wm, scales.xd + at + r, scales.xs + at + r,
                                              scales.offset + at + r, is_q4);
        }
    }
    for (int r = 0; r < (pairs ? QUANT_TILE_ROWS / 2 : QUANT_TILE_ROWS); r++)
        _mm512_storeu_ps(sums + 16 * r, acc[r]);
}
#undef QUANT_TILE_PRODUCT

/* `tile_rows` split rows (a precise q8 weight's, quantize_wide_row; sixteen, or a step's
 * nine to fifteen) against groups g and g + 1 on AMX-INT8 tiles of that many rows
 * (quant_tiles_configure(QUANT_TILES_SPLIT, tile_rows)): per block a product of the
 * rows' high parts by the signed codes (`tdpbssd`) and one of their low parts (`tdpbusd`),
 * each row's sums then 256 times the first plus the second: group_pair_tile's integers
 * (which take the unsigned codes' surplus off through offset; signed codes leave none),
 * scaled by scale_block_sums as there, so the same bits. Pipelined as group_pair_tiles:
 * block b's products run while block b - 1's sums are stored and block b - 2's scaled; the
 * next pair's block b is unpacked beside them when `next` says so. */
static inline __attribute__((always_inline)) void group_pair_split_tiles(
    const uint8_t *codes0, const uint8_t *codes1, const uint16_t *d0, const uint16_t *d1,
    int64_t blocks, const QuantizedRow *x, int64_t stride, TileScales scales, float *sums,
    const uint8_t *unpacked, int tile_rows, NextPairUnpack next) {
    uint8_t codes_tile[2][512] __attribute__((aligned(64)));
    int32_t block_sums[2][2][16 * QUANT_TILE_ROWS] __attribute__((aligned(64)));
    const int32_t no_offset = 0; /* signed codes: no surplus to take off */
    __m512 acc[QUANT_TILE_ROWS];
    for (int r = 0; r < QUANT_TILE_ROWS; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks + 2; b++) {
        if (b < blocks) {
            const uint8_t *tile = unpacked != NULL ? unpacked + b * 512 : codes_tile[b & 1];
            if (unpacked == NULL) store_signed_pair_block(codes0, codes1, b, codes_tile[b & 1]);
            const int8_t *rows = x[0].q + b * 2 * QK;
            __asm__ volatile("" ::: "memory"); /* the codes' stores before their tile load */
            _tile_loadd(2, rows, stride);
            _tile_loadd(3, rows + QK, stride);
            if (b & 1) {
                _tile_zero(6);
                _tile_zero(7);
                _tile_loadd(5, tile, 64);
                _tile_dpbssd(6, 2, 5);
                _tile_dpbusd(7, 3, 5);
            } else {
                _tile_zero(0);
                _tile_zero(1);
                _tile_loadd(4, tile, 64);
                _tile_dpbssd(0, 2, 4);
                _tile_dpbusd(1, 3, 4);
            }
            if (next.to != NULL)
                store_signed_pair_block(next.codes0, next.codes1, b, next.to + b * 512);
        }
        if (b >= 1 && b - 1 < blocks) {
            int32_t(*done)[16 * QUANT_TILE_ROWS] = block_sums[(b - 1) % 2];
            if ((b - 1) & 1) {
                _tile_stored(6, done[0], 64);
                _tile_stored(7, done[1], 64);
            } else {
                _tile_stored(0, done[0], 64);
                _tile_stored(1, done[1], 64);
            }
        }
        if (b >= 2) {
            const int64_t done = b - 2;
            const int32_t(*done_sums)[16 * QUANT_TILE_ROWS] = block_sums[done % 2];
            const __m512 wd = pair_scales(d0, d1, done);
            const int64_t at = done * QUANT_TILE_ROWS;
            for (int r = 0; r < tile_rows; r++) {
                const __m512i high = _mm512_load_si512(done_sums[0] + 16 * r);
                const __m512i low = _mm512_load_si512(done_sums[1] + 16 * r);
                acc[r] = scale_block_sums(acc[r], join_high_low(high, low), wd,
                                          _mm512_setzero_ps(), scales.xd + at + r,
                                          scales.xs + at + r, &no_offset, 0);
            }
        }
    }
    for (int r = 0; r < tile_rows; r++) _mm512_storeu_ps(sums + 16 * r, acc[r]);
}

/* How many bytes apart consecutive rows' codes of x[0..count - 1] (count >= 2) lie when
 * they are evenly spaced in ascending order (one tile load reads any sixteen of them); 0
 * otherwise. (Their scales are read from TileScales, laid out per call.) */
static inline int64_t even_code_stride(const QuantizedRow *x, int64_t count) {
    const int64_t stride = x[1].q - x[0].q;
    for (int64_t r = 2; r < count; r++)
        if (x[r].q - x[r - 1].q != stride) return 0;
    return stride > 0 ? stride : 0;
}

#endif
