/* Quantized matmuls for few rows (decode): out[r, n] = sum_k x[r, k] * w[n, k].
 *
 * Weights stay in 32-value blocks with fp16 scales, as GGUF stores them:
 * - q4: w = code * d + m, codes 0..15 (GGUF's Q4_0 / Q4_1);
 * - q8: w = code * d, codes -127..127 (GGUF's Q8_0);
 * but interleaved by eight output rows: for rows 8g..8g+7 and block b, the codes form
 * vectors whose 32-bit lane i holds four consecutive codes of row 8g + i. One integer dot
 * product instruction then advances eight output rows by four inputs against one broadcast
 * group of four activations, and a block ends as one vector of eight row sums: no
 * horizontal reductions. Layout per (g, b), row-group major:
 * - q4 codes, 128 bytes: chunk c in 0..3 is 32 bytes, byte 4i + t = code(8g + i, 4c + t)
 *   in the low nibble and code(8g + i, 16 + 4c + t) in the high one;
 * - q8 codes, 256 bytes: chunk c in 0..7, byte 4i + t = code(8g + i, 4c + t);
 * - d (and q4's m): eight fp16, one per row.
 * N is padded to a multiple of eight rows (zero scales) and only N outputs are written.
 * Each activation row is quantized once per call to int8 per 32 values (x = q * xd). The
 * dot product is AVX-512 VNNI `vpdpbusd` where the compiler targets it, AVX2 `vpmaddubsw`
 * + `vpmaddwd` where it targets that, plain C elsewhere; from 16 rows, AMX-INT8 tile
 * products where the CPU has them, with the same result bit for bit. Each weight block is
 * read once from memory for all activation rows.
 *
 * The generic driver is here; each instruction set's kernels are in quant_matmul_<isa>.h,
 * picked below by isa/isa.h's macros (plain C where a set has none of its own).
 *
 * The kernel is included by the libraries that use it (matmul alone, the decode step), so
 * everything here is static.
 */
#ifndef FORKLIFT_QUANT_MATMUL_H
#define FORKLIFT_QUANT_MATMUL_H

#include "common.h"

#include <omp.h>

#define QK 32

/* One activation row as int8 blocks: q[k], the blocks' scales xd[k / 32], for q4 weights
 * (whose codes are offset) xs[b] = xd[b] * sum(q of block b), and for q8 weights read as
 * unsigned codes (see group_pair_tile) offset[b] = 128 * sum(q of block b). */
typedef struct {
    int8_t *q;
    float *xd;
    float *xs;
    int32_t *offset;
} QuantizedRow;

/* A tile of rows' block scales (QuantizedRow's xd, xs, offset), block-major: row r's for
 * block b at [b * 16 + r]. Each row's scale is then a fixed offset from one pointer per
 * block; found through sixteen rows' pointers, the scaling loop spilled them and reloaded
 * two per row and block (scaling is most of a tile's time). */
typedef struct {
    float *xd, *xs;
    int32_t *offset;
} TileScales;

/* The scales of the tile of rows that starts at row `first` (a multiple of 16). */
static inline TileScales tile_scales_at(TileScales all, int64_t first, int64_t blocks) {
    if (all.xd == NULL) return all; /* no tiles */
    const int64_t at = first * blocks;
    return (TileScales){all.xd + at, all.xs + at, all.offset + at};
}

/* Round to nearest, ties to even, for |v| < 2^22: adding and removing 1.5 * 2^23 leaves
 * the float unit's own rounding (lrintf is a library call per value; this vectorises).
 * Correct only without -ffast-math, which the build never passes. */
static inline float round_to_even(float v) {
    const float magic = 12582912.0f;
    return (v + magic) - magic;
}

/* The multiplier of a block's codes from its scale d (max|x| / 127): 1 / d, or 0 for a block
 * of zeros and for one so small that 1 / d overflows (a denormal d: its codes all 0). */
static inline float block_inverse(float d) {
    const float reciprocal = d > 0.0f ? 1.0f / d : 0.0f;
    return reciprocal < INFINITY ? reciprocal : 0.0f;
}

/* The largest code of a q8 weight's sixteen-bit wide rows: 2^15 - 129, so that
 * quantize_paired_row's high part (q + 128) >> 8 stays a signed byte as well. */
#define WIDE_Q8_CODE_MAX 32639.0f

/* Every line of the block PREFETCH_BLOCKS blocks past `block` (a row group's blocks are one
 * stream: isa/isa.h), fetched while `block` is multiplied. */
static inline __attribute__((always_inline)) void prefetch_block_ahead(const uint8_t *block,
                                                                        int64_t block_bytes) {
    for (int64_t line = 0; line < block_bytes; line += 64)
        __builtin_prefetch(block + PREFETCH_BLOCKS * block_bytes + line, 0, PREFETCH_LOCALITY);
}

/* This build's kernels, each from the widest instruction set that has one:
 * - quantize_row (an activation row into int8 blocks): AVX-512, AVX2, else plain C;
 * - group_tile (eight outputs against up to four rows): AVX2 (also AVX-512's), else plain C;
 * - group pairs (FORKLIFT_PAIRED_GROUPS, AVX-512 VNNI) and AMX-INT8 tiles on top of them
 *   (FORKLIFT_QUANT_TILES). */
#if defined(FORKLIFT_ISA_AVX512)
#include "quant_matmul_avx512.h"
#endif
#if defined(FORKLIFT_ISA_AVX2)
#include "quant_matmul_avx2.h"
#endif
#if defined(FORKLIFT_QUANT_TILES)
#include "quant_matmul_amx.h"
#endif
#include "quant_matmul_plain.h"

/* Weights of one matmul: q4 when `m` is set, else q8. `precise`: finer activations than
 * int8, for the LM head (sampling reads its logits directly) and, where its rows are one
 * wide row (quantize.py decides), the MLP's down projection (its input carries outliers).
 * Where the paired kernels are built, each row is one wide row of codes
 * (quantize_wide_row), one row's scaling a block: a q4 weight's twelve-bit
 * codes in one integer dot product of 64 bytes, a q8 weight's sixteen-bit ones in two (the
 * high and low bytes, or a tile of eight rows as paired int8 rows, quantize_paired_row: the
 * same integer). The AVX2 kernels take a q8 weight's rows as the same sixteen-bit codes,
 * stored as int16 (quantize_wide_q8_row, group_tile_q8_wide: the same integer and scaling).
 * Elsewhere each row is two int8 rows, the quantized row and what its rounding left (about
 * 15 bits), scaled one by one. */
typedef struct {
    const uint8_t *codes;
    const uint16_t *d;
    const uint16_t *m; /* q4 only */
    int64_t n, k;      /* n: the real output rows (the layout holds ceil(n / 8) groups) */
    int32_t precise;
    int32_t dense;     /* 1: codes are dense bf16 tiles (dense_matmul.h), d and m unused */
} QuantWeight;

/* One activation row's sums for outputs first..first + width - 1: written, or with `fold`
 * (see quant_row_group) added onto the row they complete. */
static inline void store_sums(float *out, int64_t out_stride, int64_t row, int64_t fold,
                              int64_t first, const float *sums, int64_t width) {
    if (fold > 0 && row >= fold) {
        float *dst = out + (row - fold) * out_stride + first;
        for (int64_t i = 0; i < width; i++) dst[i] += sums[i];
    } else {
        float *dst = out + row * out_stride + first;
        copy_floats(dst, sums, width);
    }
}

/* out[r, 8g..8g+7] for one row group against every activation row. With `fold` > 0,
 * activation rows fold..2 fold - 1 add onto output rows 0..fold - 1 (a precise weight's
 * second halves). */
static inline void quant_row_group(const QuantWeight *w, int64_t g, const QuantizedRow *x,
                                   int64_t rows, float *out, int64_t out_stride, int64_t fold,
                                   int wide) {
    const int64_t blocks = w->k / QK;
    const int is_q4 = w->m != NULL;
    const uint8_t *codes = w->codes + g * blocks * (is_q4 ? 128 : 256);
    const uint16_t *d = w->d + g * blocks * 8;
    const uint16_t *m = is_q4 ? w->m + g * blocks * 8 : NULL;
    const int64_t first = 8 * g, width = w->n - first < 8 ? w->n - first : 8;
    for (int64_t r0 = 0; r0 < rows;) {
        const int64_t limit = fold > 0 && r0 < fold ? fold : rows;
        const int tile = limit - r0 < 4 ? (int)(limit - r0) : 4;
        float sums[32];
        /* Constants for the tile size and block type: unrolled loops, no branches. */
#define GROUP_TILE(is_q4)                                                             \
        switch (tile) {                                                               \
        case 1: group_tile(codes, d, m, blocks, x + r0, 1, sums, is_q4); break;       \
        case 2: group_tile(codes, d, m, blocks, x + r0, 2, sums, is_q4); break;       \
        case 3: group_tile(codes, d, m, blocks, x + r0, 3, sums, is_q4); break;       \
        default: group_tile(codes, d, m, blocks, x + r0, 4, sums, is_q4); break;      \
        }
        if (is_q4) {
            GROUP_TILE(1)
#if defined(FORKLIFT_WIDE_Q8_DOTS)
        } else if (wide) {
            switch (tile) {
            case 1: group_tile_q8_wide(codes, d, blocks, x + r0, 1, sums); break;
            case 2: group_tile_q8_wide(codes, d, blocks, x + r0, 2, sums); break;
            case 3: group_tile_q8_wide(codes, d, blocks, x + r0, 3, sums); break;
            default: group_tile_q8_wide(codes, d, blocks, x + r0, 4, sums); break;
            }
#endif
        } else {
            GROUP_TILE(0)
        }
#undef GROUP_TILE
        for (int t = 0; t < tile; t++)
            store_sums(out, out_stride, r0 + t, fold, first, sums + 8 * t, width);
        r0 += tile;
    }
}

#if defined(FORKLIFT_PAIRED_GROUPS)
/* Activation row `row`'s sixteen sums for groups g and g + 1 (`first` = 8 g, the groups
 * `first_width` and `second_width` outputs wide). */
static inline void store_pair_sums(float *out, int64_t out_stride, int64_t row, int64_t fold,
                                   int64_t first, const float *sums, int64_t first_width,
                                   int64_t second_width) {
    store_sums(out, out_stride, row, fold, first, sums, first_width);
    store_sums(out, out_stride, row, fold, first + 8, sums + 8, second_width);
}

/* Where a pair's unpacked blocks go (quant_row_group_pair, from two tiles of rows): `now`
 * this pair's buffer, already filled when `now_ready`; `next` the buffer for the pair after
 * it (groups g + 2 and g + 3), filled when `next_follows` (that full pair is this thread's
 * next). */
typedef struct {
    uint8_t *now, *next;
    int now_ready, next_follows;
} PairBuffers;

/* Groups g and g + 1 (g + 1 may be the last, partial one) as group_pair_tile computes them;
 * with evenly spaced rows' codes (`code_stride` bytes apart; 0: no tiles), sixteen rows at a
 * time as group_pair_tiles does, their scales from `tile_scales` (every full tile's, in
 * order). Returns 1 when it unpacked the next pair into buffers.next. */
static inline int quant_row_group_pair(const QuantWeight *w, int64_t g, const QuantizedRow *x,
                                       int64_t rows, float *out, int64_t out_stride,
                                       int64_t fold, int64_t code_stride, PairBuffers buffers,
                                       TileScales tile_scales, int wide, int lone,
                                       int tile_rows, int paired, int stream) {
    const int64_t blocks = w->k / QK;
    const int is_q4 = w->m != NULL;
    const int64_t group_bytes = blocks * (is_q4 ? 128 : 256);
    const uint8_t *codes = w->codes + g * group_bytes;
    const uint16_t *d = w->d + g * blocks * 8;
    const uint16_t *m = is_q4 ? w->m + g * blocks * 8 : NULL;
    /* `lone`: group g without a partner, paired with itself (wide rows have no kernel of
     * eight outputs); only its own outputs are stored. */
    const int64_t partner = lone ? 0 : group_bytes, partner_scales = lone ? 0 : blocks * 8;
    const int64_t first = 8 * g, first_width = w->n - first < 8 ? w->n - first : 8;
    const int64_t second_width = lone ? 0 : w->n - first - 8 < 8 ? w->n - first - 8 : 8;
#if defined(FORKLIFT_QUANT_TILES)
    /* Several tiles of rows: the pair's blocks unpacked once for all of them, so the tiles
     * read codes written long before (a tile load right after the stores that fill it waits
     * for them). */
    const uint8_t *ready = NULL;
    const int split = wide && !is_q4; /* a q8 weight's wide rows: group_pair_split_tiles */
    if (code_stride && buffers.now != NULL && rows >= 2 * QUANT_TILE_ROWS) {
        for (int64_t b = 0; b < (buffers.now_ready ? 0 : blocks); b++) {
            if (split)
                store_signed_pair_block(codes, codes + partner, b, buffers.now + b * 512);
            else
                store_pair_block(codes, codes + partner, b, is_q4, wide,
                                 buffers.now + b * (wide ? 1024 : 512));
        }
        ready = buffers.now;
    }
    /* The next pair (two full groups) is unpacked during this pair's last tile of rows. */
    const NextPairUnpack next = ready != NULL && buffers.next_follows
                                    ? (NextPairUnpack){codes + 2 * group_bytes,
                                                       codes + 3 * group_bytes, buffers.next}
                                    : NO_NEXT_PAIR;
    int next_unpacked = 0;
#else
    (void)buffers;
    (void)tile_scales;
    (void)stream;
    const int next_unpacked = 0;
#endif
    for (int64_t r0 = 0; r0 < rows;) {
#if defined(FORKLIFT_QUANT_TILES)
        /* A tile may span both halves of precise rows: rows are stored in order, each
         * second half adding onto its first, as the dot products' tiles leave them. */
        if (code_stride && rows - r0 >= tile_rows) {
            float sums[16 * QUANT_TILE_ROWS];
            const TileScales scales = tile_scales_at(tile_scales, r0, blocks);
            const int last_tile = rows - r0 < 2 * tile_rows;
            const NextPairUnpack then = last_tile ? next : NO_NEXT_PAIR;
            next_unpacked |= then.to != NULL;
            if (split)
                group_pair_split_tiles(codes, codes + partner, d, d + partner_scales, blocks,
                                       x + r0, code_stride, scales, sums, ready, tile_rows,
                                       then);
            else if (wide)
                group_pair_tiles(codes, codes + partner, d, d + partner_scales, m,
                                 m + partner_scales, blocks, x + r0, code_stride, scales, sums,
                                 1, 1, ready, 0, then);
            else if (is_q4)
                group_pair_tiles(codes, codes + partner, d, d + partner_scales, m,
                                 m + partner_scales, blocks, x + r0, code_stride, scales, sums,
                                 1, 0, ready, 0, then);
            else /* q8: int8 rows, or a tile of paired rows (eight rows' high and low) */
                group_pair_tiles(codes, codes + partner, d, d + partner_scales, NULL, NULL,
                                 blocks, x + r0, code_stride, scales, sums, 0, 0, ready, paired,
                                 then);
            if (stream && fold == 0 && !paired && first_width == 8 && second_width == 8 &&
                ((uintptr_t)(out + first) & 63) == 0 && out_stride % 16 == 0)
                for (int t = 0; t < tile_rows; t++) /* one whole cache line a row */
                    _mm512_stream_ps(out + (r0 + t) * out_stride + first,
                                     _mm512_loadu_ps(sums + 16 * t));
            else
                for (int t = 0; t < (paired ? tile_rows / 2 : tile_rows); t++)
                    store_pair_sums(out, out_stride, (paired ? r0 / 2 : r0) + t, fold, first,
                                    sums + 16 * t, first_width, second_width);
            r0 += tile_rows;
            continue;
        }
#else
        (void)code_stride;
        (void)tile_rows;
        (void)paired;
#endif
        const int64_t limit = fold > 0 && r0 < fold ? fold : rows;
        const int tile = limit - r0 < PAIR_TILE_ROWS ? (int)(limit - r0) : PAIR_TILE_ROWS;
        float sums[16 * PAIR_TILE_ROWS];
#define PAIR_TILE(is_q4, wide, rows)                                                         \
        group_pair_tile(codes, codes + partner, d, d + partner_scales, m,                    \
                        is_q4 ? m + partner_scales : NULL, blocks, x + r0, rows, sums, is_q4, \
                        wide)
#define PAIR_TILES(is_q4, wide)                                                              \
        switch (tile) {                                                                      \
        case 1: PAIR_TILE(is_q4, wide, 1); break;                                            \
        case 2: PAIR_TILE(is_q4, wide, 2); break;                                            \
        case 3: PAIR_TILE(is_q4, wide, 3); break;                                            \
        case 4: PAIR_TILE(is_q4, wide, 4); break;                                            \
        case 5: PAIR_TILE(is_q4, wide, 5); break;                                            \
        case 6: PAIR_TILE(is_q4, wide, 6); break;                                            \
        case 7: PAIR_TILE(is_q4, wide, 7); break;                                            \
        default: PAIR_TILE(is_q4, wide, 8); break;                                           \
        }
        if (wide && is_q4) {
            PAIR_TILES(1, 1)
        } else if (wide) {
            PAIR_TILES(0, 1)
        } else if (is_q4) {
            PAIR_TILES(1, 0)
        } else {
            PAIR_TILES(0, 0)
        }
#undef PAIR_TILES
#undef PAIR_TILE
        for (int t = 0; t < tile; t++)
            store_pair_sums(out, out_stride, r0 + t, fold, first, sums + 16 * t, first_width,
                            second_width);
        r0 += tile;
    }
    return next_unpacked;
}
#endif

/* Scratch for `rows` quantized activation rows of k values; NULL when out of memory. */
static inline int8_t *quantized_rows_alloc(int64_t rows, int64_t k, QuantizedRow *views) {
    const int64_t blocks = k / QK;
    /* Per row and block: xd, xs (float), offset (int32); then the codes. */
    const size_t bytes = (size_t)(rows * k) + sizeof(float) * (size_t)(3 * rows * blocks);
    float *scales = malloc(bytes);
    if (scales == NULL) return NULL;
    int32_t *offsets = (int32_t *)(scales + 2 * rows * blocks);
    int8_t *codes = (int8_t *)(offsets + rows * blocks);
    for (int64_t r = 0; r < rows; r++)
        views[r] = (QuantizedRow){codes + r * k, scales + r * blocks,
                                  scales + (rows + r) * blocks, offsets + r * blocks};
    return (int8_t *)scales;
}

/* Rows a matmul multiplies at a time (a multiple of the tiles' 16), whose codes stay in the
 * core's cache while every row group reads them: on Sapphire Rapids, the default model's
 * four projections took 1.34x as long for 2048 rows in one call as in four of 512 (128-512
 * row calls cost the same per row). */
#define QUANT_SLAB_ROWS 512

/* From this many activation rows (a prompt chunk's), the dot-product kernels' row groups go
 * to the threads in runs of GROUP_RUN as each frees up (decode steps keep fixed halves:
 * each thread streams one contiguous half of the weight). */
#define DYNAMIC_GROUPS_MIN_ROWS 64
#define GROUP_RUN 4

/* From this many bytes of output (rows x outputs x 4), the tiles' sums go to memory as
 * streaming stores, whole cache lines without reading them first: an output that large
 * leaves a 2 MB L2 before its reader comes (half of it is each of two threads' share), and
 * fetching its lines only to overwrite them held the prefill's matmuls back (1.12x without;
 * below it, a decode batch's outputs stay in cache for the next layer). */
#define QUANT_STREAM_OUTPUT_BYTES (1 << 20)

/* Rows from which activation rows are quantized on every thread. */
#define QUANTIZE_PARALLEL_ROWS 16

/* Row r of x quantized into views[r], and for a precise weight what its rounding left into
 * views[rows + r] (`rest`: k floats of scratch). Not contracted either: the residual is the
 * same whichever loop calls this. */
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("fp-contract=off")))
#endif
static inline void quantize_precise_row(const float *x, int64_t k, QuantizedRow *views,
                                        int64_t rows, int64_t r, int precise, float *rest) {
    quantize_row(x, k, views[r]);
    if (!precise) return;
    for (int64_t i = 0; i < k; i++) rest[i] = x[i] - (float)views[r].q[i] * views[r].xd[i / QK];
    quantize_row(rest, k, views[rows + r]);
}

/* Rows x[0..rows - 1] quantized into views: wide rows (quantize_wide_row), or int8 rows and
 * for a precise weight what their rounding left (quantize_precise_row). Each row is
 * quantized on its own, so how the rows are shared among the threads never changes a row's
 * codes; a prefill chunk's hundreds of rows spent a third of a step here on one thread.
 * `rest` serves one row at a time below QUANTIZE_PARALLEL_ROWS, else each precise row's
 * residual is quantized through its own second row's floats. */
static inline void quantize_rows(const QuantWeight *w, const float *x, int64_t rows,
                                 QuantizedRow *views, int wide, float *rest,
                                 int num_threads) {
    const int64_t k = w->k;
#if defined(FORKLIFT_PAIRED_GROUPS)
#define QUANTIZE_ROW(r, residual)                                                          \
    do {                                                                                   \
        if (wide)                                                                          \
            quantize_wide_row(x + (r) * k, k, views[r], w->m != NULL);                     \
        else                                                                               \
            quantize_precise_row(x + (r) * k, k, views, rows, r, w->precise, residual);   \
    } while (0)
#elif defined(FORKLIFT_WIDE_Q8_DOTS)
#define QUANTIZE_ROW(r, residual)                                                          \
    do {                                                                                   \
        if (wide)                                                                          \
            quantize_wide_q8_row(x + (r) * k, k, views[r]);                                \
        else                                                                               \
            quantize_precise_row(x + (r) * k, k, views, rows, r, w->precise, residual);   \
    } while (0)
#else
    (void)wide;
#define QUANTIZE_ROW(r, residual)                                                          \
    quantize_precise_row(x + (r) * k, k, views, rows, r, w->precise, residual)
#endif
    if (rows < QUANTIZE_PARALLEL_ROWS) {
        for (int64_t r = 0; r < rows; r++) QUANTIZE_ROW(r, rest);
    } else {
#pragma omp parallel for schedule(static) num_threads(num_threads)
        for (int64_t r = 0; r < rows; r++) {
            float residual[w->precise && !wide ? k : 1];
            QUANTIZE_ROW(r, residual);
        }
    }
#undef QUANTIZE_ROW
}

/* out [rows, n] = x [rows, k] @ W.T. `views` holds 2 * rows quantized rows of at least k
 * values, their codes evenly spaced (quantized_rows_alloc's), and `rest` k floats; a
 * precise weight's rows take two of them (with the paired kernels one wide row over both
 * rows' codes, or a q8 weight's eight rows as high and low rows; elsewhere a second row of
 * what the first's rounding left). The weight's row groups are split among the threads,
 * each block read once for every row. Returns 1 when scratch could not be allocated
 * (nothing is written). */
static inline int quant_matmul_rows(const QuantWeight *w, const float *x, int64_t rows,
                                    QuantizedRow *views, float *rest, float *out,
                                    int num_threads) {
    const int64_t k = w->k;
#if defined(FORKLIFT_PAIRED_GROUPS)
    const int wide = w->precise;
#elif defined(FORKLIFT_WIDE_Q8_DOTS)
    const int wide = w->precise && w->m == NULL;
#else
    const int wide = 0;
#endif
#if defined(FORKLIFT_QUANT_TILES)
    /* Eight rows of a q8 weight's wide rows fill one tile as paired int8 rows instead
     * (quantize_paired_row: the same codes): as split rows they would take two half-empty
     * tiles a block. */
    const int paired = wide && w->m == NULL && rows == QUANT_TILE_ROWS / 2 && amx_tiles_usable();
#else
    const int paired = 0;
#endif
    QuantizedRow *rows_views = views;
    if (wide && !paired) {
        /* Row r's 2 k codes where rows 2 r and 2 r + 1 would be; its scales as row r's. */
        rows_views = malloc(sizeof(QuantizedRow) * (size_t)rows);
        if (rows_views == NULL) return 1;
        const int64_t code_step = views[1].q - views[0].q; /* views: at least two rows */
        for (int64_t r = 0; r < rows; r++)
            rows_views[r] = (QuantizedRow){views[0].q + 2 * r * code_step, views[r].xd,
                                           views[r].xs, views[r].offset};
    }
#if defined(FORKLIFT_QUANT_TILES)
    if (paired)
        for (int64_t r = 0; r < rows; r++)
            quantize_paired_row(x + r * k, k, views[2 * r], views[2 * r + 1]);
    else
#endif
        quantize_rows(w, x, rows, rows_views, wide, rest, num_threads);
    const int two_rows = w->precise && !wide; /* a row and what its rounding left */
    const int64_t active = two_rows || paired ? 2 * rows : rows, fold = two_rows ? rows : 0;
    const int64_t groups = (w->n + 7) / 8;
#if defined(FORKLIFT_QUANT_TILES)
    /* Sixteen rows on the tiles (precise rows count twice): at eight a tile is half empty
     * and the dot products win, but for a q8 weight's split rows, two dot products a
     * block, nine to fifteen rows take one tile of that many. */
    const int tile_rows = wide && !paired && w->m == NULL && active >= SPLIT_TILE_MIN_ROWS &&
                                  active < QUANT_TILE_ROWS
                              ? (int)active
                              : QUANT_TILE_ROWS;
    int64_t code_stride = active >= tile_rows && amx_tiles_usable()
                              ? even_code_stride(rows_views, active)
                              : 0;
#elif defined(FORKLIFT_PAIRED_GROUPS)
    const int64_t code_stride = 0; /* no tiles: pairs by dot products only */
    const int tile_rows = 0;
#endif
    TileScales tile_scales = {NULL, NULL, NULL};
#if defined(FORKLIFT_QUANT_TILES)
    const int64_t tiles = code_stride ? active / tile_rows : 0, blocks = k / QK;
    if (tiles > 0) {
        const int64_t count = tiles * blocks * QUANT_TILE_ROWS;
        tile_scales.xd = malloc(sizeof(float) * (size_t)(3 * count));
        if (tile_scales.xd == NULL) {
            code_stride = 0; /* no room: the dot products, which need none */
        } else {
            tile_scales.xs = tile_scales.xd + count;
            tile_scales.offset = (int32_t *)(tile_scales.xs + count);
        }
    }
#endif
#if defined(FORKLIFT_PAIRED_GROUPS)
    const int stream = (int64_t)sizeof(float) * rows * w->n >= QUANT_STREAM_OUTPUT_BYTES;
#endif
#pragma omp parallel num_threads(num_threads)
    {
        /* A pair's unpacked blocks, reused by every tile of rows (NULL: unpack per tile), and
         * the next pair's, unpacked beside the last tile (PairBuffers). */
        uint8_t *unpacked[2] = {NULL, NULL};
#if defined(FORKLIFT_QUANT_TILES)
        if (code_stride) {
#pragma omp for schedule(static)
            for (int64_t t = 0; t < tiles; t++)
                transpose_tile_scales(rows_views, t, blocks, tile_scales, tile_rows);
            quant_tiles_configure(!wide || paired ? QUANT_TILES_INT8
                                  : w->m != NULL ? QUANT_TILES_WIDE : QUANT_TILES_SPLIT,
                                  tile_rows);
        }
        if (code_stride && active >= 2 * QUANT_TILE_ROWS) { /* NULL, no room: per tile */
            const size_t bytes = (size_t)(k / QK) * (wide && w->m != NULL ? 1024 : 512);
            unpacked[0] = aligned_alloc(64, 2 * bytes);
            unpacked[1] = unpacked[0] == NULL ? NULL : unpacked[0] + bytes;
        }
#endif

        /* A slab of rows at a time, through every group a thread takes: a slab's codes stay
         * in the core's cache while every group reads them (a pair reads all the rows it is
         * given, per pair). Precise rows (fold) go in one slab: their halves add up. */
        const int64_t slab = fold > 0 ? active : QUANT_SLAB_ROWS;
#if !defined(FORKLIFT_PAIRED_GROUPS)
        if (active >= DYNAMIC_GROUPS_MIN_ROWS) {
            /* Runs of groups handed out in order, slab by slab, to whichever thread is free,
             * large shares first and smaller ones as the work runs out: with halves fixed in
             * advance, a core its neighbour slowed kept the other waiting at the end. Which
             * thread computes a group changes no bits. */
            const int64_t runs = (groups + GROUP_RUN - 1) / GROUP_RUN;
            const int64_t items = (active + slab - 1) / slab * runs;
#pragma omp for schedule(guided) nowait
            for (int64_t item = 0; item < items; item++) {
                const int64_t first = item / runs * slab, g0 = item % runs * GROUP_RUN;
                const int64_t count = active - first < slab ? active - first : slab;
                const int64_t g1 = g0 + GROUP_RUN < groups ? g0 + GROUP_RUN : groups;
                for (int64_t g = g0; g < g1; g++)
                    quant_row_group(w, g, rows_views + first, count, out + first * w->n, w->n,
                                    fold, wide);
            }
        } else
#endif
        {
            const int64_t threads = omp_get_num_threads(), id = omp_get_thread_num();
            const int64_t per = (groups + threads - 1) / threads;
            const int64_t begin = id * per < groups ? id * per : groups;
            const int64_t end = begin + per < groups ? begin + per : groups;
            for (int64_t first = 0; first < active; first += slab) {
                const int64_t count = active - first < slab ? active - first : slab;
                const QuantizedRow *slab_views = rows_views + first;
                float *slab_out = out + first * w->n;
#if defined(FORKLIFT_PAIRED_GROUPS)
                int current = 0, ready = 0; /* which buffer is this pair's; filled already */
#endif
                for (int64_t g = begin; g < end; g++) {
#if defined(FORKLIFT_PAIRED_GROUPS)
                    if (g + 1 < end || wide) {
                        const PairBuffers buffers = {unpacked[current], unpacked[1 - current],
                                                     ready, g + 3 < end};
                        ready = quant_row_group_pair(w, g, slab_views, count, slab_out, w->n,
                                                     fold, code_stride, buffers,
                                                     tile_scales_at(tile_scales, first, k / QK),
                                                     wide && !paired, g + 1 >= end, tile_rows,
                                                     paired, stream);
                        if (ready) current = 1 - current;
                        g++;
                        continue;
                    }
#endif
                    quant_row_group(w, g, slab_views, count, slab_out, w->n, fold, wide);
                }
            }
        }
#if defined(FORKLIFT_QUANT_TILES)
        if (stream) _mm_sfence(); /* the streamed rows visible before the threads join */
        if (code_stride) amx_tiles_release();
#endif
        free(unpacked[0]); /* both buffers */
    }
    free(tile_scales.xd);
    if (rows_views != views) free(rows_views);
    return 0;
}

#endif