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

/* The distance between consecutive rows of a run of QuantizedRows, per field (see
 * even_row_strides); q == 0: the rows are not evenly spaced. */
typedef struct {
    int64_t q, xd, xs, offset;
} RowStrides;

/* Round to nearest, ties to even, for |v| < 2^22: adding and removing 1.5 * 2^23 leaves
 * the float unit's own rounding (lrintf is a library call per value; this vectorises).
 * Correct only without -ffast-math, which the build never passes. */
static inline float round_to_even(float v) {
    const float magic = 12582912.0f;
    return (v + magic) - magic;
}

#if defined(__AVX512F__)
/* quantize_row's work on AVX-512, each block of 32 as two vectors: the same operations on
 * the same values (the largest magnitude, one division, one reciprocal, a product rounded
 * before the rounding constant is added), so the same codes, scales and sums bit for bit; a
 * prefill chunk spent a tenth of its time quantizing rows one value at a time. */
static inline void quantize_row_vectors(const float *x, int64_t k, QuantizedRow row) {
    const __m512 magic = _mm512_set1_ps(12582912.0f);
    for (int64_t b = 0; b < k / QK; b++) {
        const __m512 lo = _mm512_loadu_ps(x + b * QK), hi = _mm512_loadu_ps(x + b * QK + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo),
                                                              _mm512_abs_ps(hi)));
        const float d = amax / 127.0f;
        const __m512 inverse = _mm512_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
        const __m512i q_lo = _mm512_cvttps_epi32(
            _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(lo, inverse), magic), magic));
        const __m512i q_hi = _mm512_cvttps_epi32(
            _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(hi, inverse), magic), magic));
        _mm_storeu_si128((__m128i *)(row.q + b * QK), _mm512_cvtepi32_epi8(q_lo));
        _mm_storeu_si128((__m128i *)(row.q + b * QK + 16), _mm512_cvtepi32_epi8(q_hi));
        const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q_lo, q_hi));
        row.xd[b] = d;
        row.xs[b] = d * (float)sum;
        row.offset[b] = 128 * sum;
    }
}
#endif

/* No fused multiply-add in here: rounding x * inverse before adding the rounding constant
 * is what keeps the codes those of a plain round(x / d) (clang fuses only within one
 * expression, GCC across statements unless told). */
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("fp-contract=off")))
#endif
static inline void quantize_row(const float *x, int64_t k, QuantizedRow row) {
#if defined(__AVX512F__)
    quantize_row_vectors(x, k, row);
#else
    for (int64_t b = 0; b < k / QK; b++) {
        const float *xb = x + b * QK;
        float amax = 0.0f;
        for (int i = 0; i < QK; i++) {
            const float a = fabsf(xb[i]);
            amax = a > amax ? a : amax;
        }
        const float d = amax / 127.0f;
        const float inverse = d > 0.0f ? 1.0f / d : 0.0f;
        int32_t sum = 0;
        for (int i = 0; i < QK; i++) {
            const float scaled = xb[i] * inverse;
            const int32_t q = (int32_t)round_to_even(scaled);
            row.q[b * QK + i] = (int8_t)q;
            sum += q;
        }
        row.xd[b] = d;
        row.xs[b] = d * (float)sum;
        row.offset[b] = 128 * sum;
    }
#endif
}


/* Software prefetch this many blocks ahead of the one being multiplied: a row group's blocks
 * are one contiguous stream, and 32 blocks (4-8 KB) ahead read 30 layers' projections
 * 1.13-1.50x faster than none. The AVX-512 build, two streams at a time and faster per
 * block, ran 1.02-1.08x faster again at 64 blocks, where the AVX2 build ran 0.96-0.99x as
 * fast (benchmarks/scripts/prefetch_distance.py). A prefetch past the end of the weights
 * never faults. */
#ifndef PREFETCH_BLOCKS
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define PREFETCH_BLOCKS 64
#else
#define PREFETCH_BLOCKS 32
#endif
#endif

#if defined(__AVX2__)
/* acc + the int32 sums of u[4i..4i+3] * s[4i..4i+3] per lane i (unsigned by signed). */
static inline __m256i dot_accumulate(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s),
                                                   _mm256_set1_epi16(1)));
#endif
}
#endif

/* Eight output rows (one row group) against `rows` activation rows, at most 4 at a time
 * so the sums stay in registers; sums[r * 8 + i] receives row group lane i. */
static inline __attribute__((always_inline)) void group_tile(
    const uint8_t *codes, const uint16_t *d, const uint16_t *m, int64_t blocks,
    const QuantizedRow *x, int rows, float *sums, int is_q4) {
    const int64_t block_bytes = is_q4 ? 128 : 256;
#if defined(__AVX2__)
    /* Two sums per row (scaled dots, q4 offsets): two short dependency chains, not one. */
    __m256 acc[4], offsets[4];
    for (int r = 0; r < 4; r++) acc[r] = offsets[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *block = codes + b * block_bytes;
        for (int64_t line = 0; line < block_bytes; line += 64)
            __builtin_prefetch(block + PREFETCH_BLOCKS * block_bytes + line);
        __m256i w[8], signs[8];
        if (is_q4) {
            const __m256i low = _mm256_set1_epi8(0x0f);
            for (int c = 0; c < 4; c++) {
                const __m256i packed = _mm256_loadu_si256((const __m256i *)(block + 32 * c));
                w[c] = _mm256_and_si256(packed, low);
                w[c + 4] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
            }
        } else { /* signed by signed as |w| by (x with w's sign) */
            for (int c = 0; c < 8; c++) {
                signs[c] = _mm256_loadu_si256((const __m256i *)(block + 32 * c));
                w[c] = _mm256_sign_epi8(signs[c], signs[c]);
            }
        }
        const __m256 wd = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d + 8 * b)));
        const __m256 wm = is_q4 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(m + 8 * b)))
                                : _mm256_setzero_ps();
        for (int r = 0; r < rows; r++) {
            const int32_t *xq = (const int32_t *)(x[r].q + b * QK);
            __m256i even = _mm256_setzero_si256(), odd = _mm256_setzero_si256();
            for (int c = 0; c < 8; c += 2) {
                __m256i x0 = _mm256_set1_epi32(xq[c]), x1 = _mm256_set1_epi32(xq[c + 1]);
                if (!is_q4) {
                    x0 = _mm256_sign_epi8(x0, signs[c]);
                    x1 = _mm256_sign_epi8(x1, signs[c + 1]);
                }
                even = dot_accumulate(even, w[c], x0);
                odd = dot_accumulate(odd, w[c + 1], x1);
            }
            const __m256 total = _mm256_cvtepi32_ps(_mm256_add_epi32(even, odd));
            acc[r] = _mm256_fmadd_ps(total, _mm256_mul_ps(wd, _mm256_set1_ps(x[r].xd[b])), acc[r]);
            if (is_q4) offsets[r] = _mm256_fmadd_ps(wm, _mm256_set1_ps(x[r].xs[b]), offsets[r]);
        }
    }
    for (int r = 0; r < rows; r++) _mm256_storeu_ps(sums + 8 * r, _mm256_add_ps(acc[r], offsets[r]));
#else
    for (int i = 0; i < 8 * rows; i++) sums[i] = 0.0f;
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *block = codes + b * block_bytes;
        for (int i = 0; i < 8; i++) {
            const float wd = fp16_to_float(d[8 * b + i]);
            const float wm = is_q4 ? fp16_to_float(m[8 * b + i]) : 0.0f;
            for (int r = 0; r < rows; r++) {
                const int8_t *xq = x[r].q + b * QK;
                int32_t dot = 0;
                for (int c = 0; c < 8; c++)
                    for (int t = 0; t < 4; t++) {
                        const int code = is_q4 ? (c < 4 ? block[32 * c + 4 * i + t] & 0x0f
                                                        : block[32 * (c - 4) + 4 * i + t] >> 4)
                                               : (int8_t)block[32 * c + 4 * i + t];
                        dot += code * xq[4 * c + t];
                    }
                sums[8 * r + i] += wd * x[r].xd[b] * (float)dot + wm * x[r].xs[b];
            }
        }
    }
#endif
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define FORKLIFT_PAIRED_GROUPS 1
#define PAIR_TILE_ROWS 8
/* Block b of groups g and g + 1 (`first`, `second`) as eight vectors: vector c, lane i holds
 * the four codes of inputs 4c..4c + 3 for output i of group g (lanes 0-7) or of group g + 1
 * (lanes 8-15), unsigned (q8 codes as w + 128). */
static inline __attribute__((always_inline)) void unpack_pair_block(
    const uint8_t *first, const uint8_t *second, int is_q4, __m512i w[8]) {
#define BOTH_GROUPS(offset)                                                                   \
    _mm512_inserti64x4(                                                                       \
        _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(first + (offset)))),      \
        _mm256_loadu_si256((const __m256i *)(second + (offset))), 1)
    if (is_q4) {
        const __m512i low = _mm512_set1_epi8(0x0f);
        for (int c = 0; c < 4; c++) {
            const __m512i packed = BOTH_GROUPS(32 * c);
            w[c] = _mm512_and_si512(packed, low);
            w[c + 4] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
        }
    } else { /* signed codes as unsigned w + 128, the surplus 128 * sum(x) taken off */
        const __m512i bias = _mm512_set1_epi8((char)0x80);
        for (int c = 0; c < 8; c++) w[c] = _mm512_xor_si512(BOTH_GROUPS(32 * c), bias);
    }
#undef BOTH_GROUPS
}

/* Block b of groups g and g + 1 (their codes from `codes0`, `codes1`) unpacked as
 * unpack_pair_block does, the two streams fetched PREFETCH_BLOCKS ahead. */
static inline __attribute__((always_inline)) void fetch_pair_block(
    const uint8_t *codes0, const uint8_t *codes1, int64_t b, int is_q4, __m512i w[8]) {
    const int64_t block_bytes = is_q4 ? 128 : 256;
    const uint8_t *first = codes0 + b * block_bytes, *second = codes1 + b * block_bytes;
    for (int64_t line = 0; line < block_bytes; line += 64) {
        __builtin_prefetch(first + PREFETCH_BLOCKS * block_bytes + line);
        __builtin_prefetch(second + PREFETCH_BLOCKS * block_bytes + line);
    }
    unpack_pair_block(first, second, is_q4, w);
}

/* Block b of groups g and g + 1 unpacked as fetch_pair_block does, stored as the tiles read
 * it: 512 bytes at `dst`. */
static inline __attribute__((always_inline)) void store_pair_block(
    const uint8_t *codes0, const uint8_t *codes1, int64_t b, int is_q4, uint8_t *dst) {
    __m512i w[8];
    fetch_pair_block(codes0, codes1, b, is_q4, w);
    for (int c = 0; c < 8; c++) _mm512_store_si512(dst + 64 * c, w[c]);
}

/* Block b's sixteen fp16 scales (d or m) of groups g and g + 1 as floats. */
static inline __m512 pair_scales(const uint16_t *first, const uint16_t *second, int64_t b) {
    return _mm512_cvtph_ps(_mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(first + 8 * b))),
        _mm_loadu_si128((const __m128i *)(second + 8 * b)), 1));
}

/* One activation row's block sums (int32, one lane per output of the pair) into its
 * accumulator: the scaled dot, and for q4 the codes' offset. xd, xs and offset point at the
 * row's entries for the block (a QuantizedRow's fields plus the block). Both paths below end
 * every block here, so a row's result is the same whichever multiplied it. */
static inline __attribute__((always_inline)) __m512 scale_block_sums(
    __m512 acc, __m512i dots, __m512 wd, __m512 wm, const float *xd, const float *xs,
    const int32_t *offset, int is_q4) {
    if (!is_q4) dots = _mm512_sub_epi32(dots, _mm512_set1_epi32(*offset));
    const __m512 total = _mm512_cvtepi32_ps(dots);
    acc = _mm512_fmadd_ps(total, _mm512_mul_ps(wd, _mm512_set1_ps(*xd)), acc);
    if (is_q4) acc = _mm512_fmadd_ps(wm, _mm512_set1_ps(*xs), acc);
    return acc;
}

/* Two row groups at once in 512-bit registers (lanes 0-7: group g, 8-15: group g + 1):
 * the activations' broadcasts and the dot products serve sixteen outputs, half the
 * instructions per output of group_tile. Up to PAIR_TILE_ROWS rows share each block's
 * unpacked codes, one accumulator each (the thirty-two registers hold them all). A row's
 * sums take the same steps in the same order whatever the tile's size: a row's result never
 * depends on the rows beside it (speculation's lossless greedy rests on it). Q8 codes go
 * in as unsigned w + 128 (one xor per block, shared by the rows) and each row's block sum
 * times 128 comes off its integer dot: the same int32 as signed by signed, with no
 * per-row negation (vpdpbusd never saturates; AVX2's vpmaddubsw would, so group_tile keeps
 * the sign trick). sums[r * 16 + i]. */
static inline __attribute__((always_inline)) void group_pair_tile(
    const uint8_t *codes0, const uint8_t *codes1, const uint16_t *d0, const uint16_t *d1,
    const uint16_t *m0, const uint16_t *m1, int64_t blocks, const QuantizedRow *x, int rows,
    float *sums, int is_q4) {
    __m512 acc[PAIR_TILE_ROWS];
    for (int r = 0; r < PAIR_TILE_ROWS; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        __m512i w[8];
        fetch_pair_block(codes0, codes1, b, is_q4, w);
        const __m512 wd = pair_scales(d0, d1, b);
        const __m512 wm = is_q4 ? pair_scales(m0, m1, b) : _mm512_setzero_ps();
        for (int r = 0; r < rows; r++) {
            const int32_t *xq = (const int32_t *)(x[r].q + b * QK);
            __m512i even = _mm512_setzero_si512(), odd = _mm512_setzero_si512();
            for (int c = 0; c < 8; c += 2) {
                even = _mm512_dpbusd_epi32(even, w[c], _mm512_set1_epi32(xq[c]));
                odd = _mm512_dpbusd_epi32(odd, w[c + 1], _mm512_set1_epi32(xq[c + 1]));
            }
            acc[r] = scale_block_sums(acc[r], _mm512_add_epi32(even, odd), wd, wm, x[r].xd + b,
                                      x[r].xs + b, x[r].offset + b, is_q4);
        }
    }
    for (int r = 0; r < rows; r++) _mm512_storeu_ps(sums + 16 * r, acc[r]);
}

#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define FORKLIFT_QUANT_TILES 1
#define QUANT_TILE_ROWS 16

/* Tiles 0, 1: a block's int32 sums (16 rows x 16 outputs), even and odd blocks; 2, 3: the
 * rows' codes of the block (16 x 32 bytes); 4, 5: the pair's unpacked codes (8 x 64 bytes,
 * vector c of unpack_pair_block as row c: the B operand's layout of four inputs per
 * output). */
static inline void quant_tiles_configure(void) {
    AmxTileConfig config = {.palette = 1};
    for (int t = 0; t < 2; t++) {
        config.colsb[t] = 64;
        config.rows[t] = 16;
        config.colsb[2 + t] = 32;
        config.rows[2 + t] = 16;
        config.colsb[4 + t] = 64;
        config.rows[4 + t] = 8;
    }
    _tile_loadconfig(&config);
}

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
 * are scaled, so no step waits on the one before it. The rows' codes lie `stride` bytes
 * apart. sums[r * 16 + i]. */
static inline __attribute__((always_inline)) void group_pair_tiles(
    const uint8_t *codes0, const uint8_t *codes1, const uint16_t *d0, const uint16_t *d1,
    const uint16_t *m0, const uint16_t *m1, int64_t blocks, const QuantizedRow *x,
    RowStrides stride, float *sums, int is_q4, const uint8_t *unpacked) {
    uint8_t codes_tile[2][512] __attribute__((aligned(64)));
    /* Slot b % 2 takes block b's sums one iteration after its product and is read the next:
     * by then the slot's previous block has been scaled. */
    int32_t block_sums[2][16 * QUANT_TILE_ROWS] __attribute__((aligned(64)));
    __m512 acc[QUANT_TILE_ROWS];
    for (int r = 0; r < QUANT_TILE_ROWS; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks + 2; b++) {
        if (b < blocks) {
            const uint8_t *tile = unpacked != NULL ? unpacked + b * 512 : codes_tile[b & 1];
            if (unpacked == NULL) store_pair_block(codes0, codes1, b, is_q4, codes_tile[b & 1]);
            if (b & 1)
                QUANT_TILE_PRODUCT(1, 3, 5, x[0].q + b * QK, stride.q, tile);
            else
                QUANT_TILE_PRODUCT(0, 2, 4, x[0].q + b * QK, stride.q, tile);
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
            /* Each row's scales found by its stride: the rows' pointers would be reloaded
             * per block (the tile asm clobbers memory). */
            const float *xd = x[0].xd + done, *xs = x[0].xs + done;
            const int32_t *offset = x[0].offset + done;
            for (int r = 0; r < QUANT_TILE_ROWS; r++)
                acc[r] = scale_block_sums(acc[r], _mm512_load_si512(done_sums + 16 * r), wd, wm,
                                          xd + r * stride.xd, xs + r * stride.xs,
                                          offset + r * stride.offset, is_q4);
        }
    }
    for (int r = 0; r < QUANT_TILE_ROWS; r++) _mm512_storeu_ps(sums + 16 * r, acc[r]);
}
#undef QUANT_TILE_PRODUCT

/* How far apart consecutive rows of x[0..count - 1] (count >= 2) lie when every field's
 * rows are evenly spaced, the codes in ascending order (one tile load reads any sixteen of
 * them): bytes for the codes, elements for the scales; all 0 otherwise. */
static inline RowStrides even_row_strides(const QuantizedRow *x, int64_t count) {
    const RowStrides none = {0, 0, 0, 0};
    const RowStrides stride = {x[1].q - x[0].q, x[1].xd - x[0].xd, x[1].xs - x[0].xs,
                               x[1].offset - x[0].offset};
    for (int64_t r = 2; r < count; r++)
        if (x[r].q - x[r - 1].q != stride.q || x[r].xd - x[r - 1].xd != stride.xd ||
            x[r].xs - x[r - 1].xs != stride.xs || x[r].offset - x[r - 1].offset != stride.offset)
            return none;
    return stride.q > 0 ? stride : none;
}

/* 1 where this process may use the tiles; asked of the kernel once (the answer never
 * changes), since every matmul of 16 rows or more needs it. */
static inline int quant_tiles_usable(void) {
    static int usable = -1; /* -1: not asked yet; threads that race store the same answer */
    int known = __atomic_load_n(&usable, __ATOMIC_RELAXED);
    if (known < 0) {
        known = amx_tiles_granted();
        __atomic_store_n(&usable, known, __ATOMIC_RELAXED);
    }
    return known;
}
#endif
#endif

/* Weights of one matmul: q4 when `m` is set, else q8. `precise`: activations go in as
 * two int8 rows each, the quantized row and what its rounding left (about 15 bits instead
 * of 8, for twice the integer work): for the LM head, whose logits sampling reads
 * directly. */
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
#if defined(__AVX2__)
        if (width == 8) { /* a whole group: one store, not a library call per row */
            _mm256_storeu_ps(dst, _mm256_loadu_ps(sums));
            return;
        }
#endif
        memcpy(dst, sums, sizeof(float) * (size_t)width);
    }
}

/* out[r, 8g..8g+7] for one row group against every activation row. With `fold` > 0,
 * activation rows fold..2 fold - 1 add onto output rows 0..fold - 1 (a precise weight's
 * second halves). */
static inline void quant_row_group(const QuantWeight *w, int64_t g, const QuantizedRow *x,
                                   int64_t rows, float *out, int64_t out_stride, int64_t fold) {
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
/* Activation row `row`'s sixteen sums for groups g and g + 1 (`first` = 8 g, the second
 * group `second_width` outputs wide). */
static inline void store_pair_sums(float *out, int64_t out_stride, int64_t row, int64_t fold,
                                   int64_t first, const float *sums, int64_t second_width) {
    store_sums(out, out_stride, row, fold, first, sums, 8);
    store_sums(out, out_stride, row, fold, first + 8, sums + 8, second_width);
}

/* Groups g and g + 1 (g + 1 may be the last, partial one) as group_pair_tile computes them;
 * with evenly spaced rows (`strides.q` > 0; 0: no tiles), sixteen rows at a time as
 * group_pair_tiles does. */
static inline void quant_row_group_pair(const QuantWeight *w, int64_t g, const QuantizedRow *x,
                                        int64_t rows, float *out, int64_t out_stride,
                                        int64_t fold, RowStrides strides, uint8_t *unpacked) {
    const int64_t blocks = w->k / QK;
    const int is_q4 = w->m != NULL;
    const int64_t group_bytes = blocks * (is_q4 ? 128 : 256);
    const uint8_t *codes = w->codes + g * group_bytes;
    const uint16_t *d = w->d + g * blocks * 8;
    const uint16_t *m = is_q4 ? w->m + g * blocks * 8 : NULL;
    const int64_t first = 8 * g, second_width = w->n - first - 8 < 8 ? w->n - first - 8 : 8;
#if defined(FORKLIFT_QUANT_TILES)
    /* Several tiles of rows: the pair's blocks unpacked once for all of them, so the tiles
     * read codes written long before (a tile load right after the stores that fill it waits
     * for them). */
    const uint8_t *ready = NULL;
    if (strides.q && unpacked != NULL && rows >= 2 * QUANT_TILE_ROWS) {
        for (int64_t b = 0; b < blocks; b++)
            store_pair_block(codes, codes + group_bytes, b, is_q4, unpacked + b * 512);
        ready = unpacked;
    }
#else
    (void)unpacked;
#endif
    for (int64_t r0 = 0; r0 < rows;) {
#if defined(FORKLIFT_QUANT_TILES)
        /* A tile may span both halves of precise rows: rows are stored in order, each
         * second half adding onto its first, as the dot products' tiles leave them. */
        if (strides.q && rows - r0 >= QUANT_TILE_ROWS) {
            float sums[16 * QUANT_TILE_ROWS];
            if (is_q4)
                group_pair_tiles(codes, codes + group_bytes, d, d + blocks * 8, m,
                                 m + blocks * 8, blocks, x + r0, strides, sums, 1, ready);
            else
                group_pair_tiles(codes, codes + group_bytes, d, d + blocks * 8, NULL, NULL,
                                 blocks, x + r0, strides, sums, 0, ready);
            for (int t = 0; t < QUANT_TILE_ROWS; t++)
                store_pair_sums(out, out_stride, r0 + t, fold, first, sums + 16 * t,
                                second_width);
            r0 += QUANT_TILE_ROWS;
            continue;
        }
#else
        (void)strides;
#endif
        const int64_t limit = fold > 0 && r0 < fold ? fold : rows;
        const int tile = limit - r0 < PAIR_TILE_ROWS ? (int)(limit - r0) : PAIR_TILE_ROWS;
        float sums[16 * PAIR_TILE_ROWS];
#define PAIR_TILE(is_q4, rows)                                                               \
        group_pair_tile(codes, codes + group_bytes, d, d + blocks * 8, m,                    \
                        is_q4 ? m + blocks * 8 : NULL, blocks, x + r0, rows, sums, is_q4)
#define PAIR_TILES(is_q4)                                                                    \
        switch (tile) {                                                                      \
        case 1: PAIR_TILE(is_q4, 1); break;                                                  \
        case 2: PAIR_TILE(is_q4, 2); break;                                                  \
        case 3: PAIR_TILE(is_q4, 3); break;                                                  \
        case 4: PAIR_TILE(is_q4, 4); break;                                                  \
        case 5: PAIR_TILE(is_q4, 5); break;                                                  \
        case 6: PAIR_TILE(is_q4, 6); break;                                                  \
        case 7: PAIR_TILE(is_q4, 7); break;                                                  \
        default: PAIR_TILE(is_q4, 8); break;                                                 \
        }
        if (is_q4) {
            PAIR_TILES(1)
        } else {
            PAIR_TILES(0)
        }
#undef PAIR_TILES
#undef PAIR_TILE
        for (int t = 0; t < tile; t++)
            store_pair_sums(out, out_stride, r0 + t, fold, first, sums + 16 * t, second_width);
        r0 += tile;
    }
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

/* out [rows, n] = x [rows, k] @ W.T. `views` holds 2 * rows quantized rows of at least k
 * values and `rest` k floats (a precise weight's second rows); the weight's row groups are
 * split among the threads, each block read once for every row. */
static inline void quant_matmul_rows(const QuantWeight *w, const float *x, int64_t rows,
                                     QuantizedRow *views, float *rest, float *out,
                                     int num_threads) {
    const int64_t k = w->k;
    /* Each row is quantized on its own, so how the rows are shared among the threads never
     * changes a row's codes; a prefill chunk's hundreds of rows spent a third of a step
     * here on one thread. `rest` serves one row at a time below QUANTIZE_PARALLEL_ROWS,
     * else each precise row's residual is quantized through its own second row's floats. */
    if (rows < QUANTIZE_PARALLEL_ROWS) {
        for (int64_t r = 0; r < rows; r++) quantize_precise_row(x + r * k, k, views, rows, r,
                                                                w->precise, rest);
    } else {
#pragma omp parallel for schedule(static) num_threads(num_threads)
        for (int64_t r = 0; r < rows; r++) {
            float residual[w->precise ? k : 1];
            quantize_precise_row(x + r * k, k, views, rows, r, w->precise, residual);
        }
    }
    const int64_t active = w->precise ? 2 * rows : rows, fold = w->precise ? rows : 0;
    const int64_t groups = (w->n + 7) / 8;
#if defined(FORKLIFT_QUANT_TILES)
    /* Sixteen rows on the tiles (precise rows count twice): at eight a tile is half empty
     * and the dot products win. */
    const RowStrides none = {0, 0, 0, 0};
    const RowStrides strides = active >= QUANT_TILE_ROWS && quant_tiles_usable()
                                   ? even_row_strides(views, active)
                                   : none;
#else
    const RowStrides strides = {0, 0, 0, 0};
#endif
#pragma omp parallel num_threads(num_threads)
    {
        uint8_t *unpacked = NULL;
#if defined(FORKLIFT_QUANT_TILES)
        if (strides.q) quant_tiles_configure();
        /* A pair's unpacked blocks, reused by every tile of rows (NULL: unpack per tile). */
        if (strides.q && active >= 2 * QUANT_TILE_ROWS)
            unpacked = aligned_alloc(64, (size_t)(k / QK) * 512);
#endif
        const int64_t threads = omp_get_num_threads(), id = omp_get_thread_num();
        const int64_t per = (groups + threads - 1) / threads;
        const int64_t begin = id * per < groups ? id * per : groups;
        const int64_t end = begin + per < groups ? begin + per : groups;
        for (int64_t g = begin; g < end; g++) {
#if defined(FORKLIFT_PAIRED_GROUPS)
            if (g + 1 < end) {
                quant_row_group_pair(w, g++, views, active, out, w->n, fold, strides,
                                     unpacked);
                continue;
            }
#endif
            quant_row_group(w, g, views, active, out, w->n, fold);
        }
#if defined(FORKLIFT_QUANT_TILES)
        if (strides.q) _tile_release();
#endif
        free(unpacked);
    }
}

#endif
