/* The quantized matmul's eight-output kernel on AVX2 (quant_matmul.h has the layout), also
 * AVX-512's for a row group without a partner: 256-bit integer dot products (isa/avx2.h's
 * dot_accumulate: vpmaddubsw + vpmaddwd, in a kernel per code type that takes each chunk of
 * codes row by row; or vpdpbusd with AVX512-VNNI/VL). */
#ifndef FORKLIFT_QUANT_MATMUL_AVX2_H
#define FORKLIFT_QUANT_MATMUL_AVX2_H

/* A block of 32 values at xb as codes q = round(x / d) in four vectors of int32, with
 * d = max |x| / code_max returned (quantize_row's and quantize_wide_q8_row's rule): the
 * largest magnitude (a maximum is exact in any order), one scalar division and reciprocal,
 * each product rounded before the rounding constant is added (not contracted: see the
 * attribute). */
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("fp-contract=off")))
#endif
static inline __attribute__((always_inline)) float round_block_avx2(const float *xb,
                                                                    float code_max,
                                                                    __m256i q[4]) {
    const __m256 sign = _mm256_set1_ps(-0.0f), magic = _mm256_set1_ps(12582912.0f);
    __m256 v[4];
    for (int c = 0; c < 4; c++) v[c] = _mm256_loadu_ps(xb + 8 * c);
    const __m256 top = _mm256_max_ps(
        _mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
        _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
    __m128 half = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
    half = _mm_max_ps(half, _mm_movehl_ps(half, half));
    half = _mm_max_ss(half, _mm_movehdup_ps(half));
    const float d = _mm_cvtss_f32(half) / code_max;
    const __m256 inverse = _mm256_set1_ps(block_inverse(d));
    for (int c = 0; c < 4; c++) {
        const __m256 scaled = _mm256_mul_ps(v[c], inverse);
        q[c] = _mm256_cvttps_epi32(_mm256_sub_ps(_mm256_add_ps(scaled, magic), magic));
    }
    return d;
}

#if !defined(FORKLIFT_HAS_VNNI_256)
/* group_tile for q4 codes without VNNI (vpmaddubsw): each chunk of a block's codes is
 * unpacked as it is used and taken by every row in turn, each row's block sum one 16-bit
 * vector. q4 codes are at most 15, so each 16-bit pair sum of vpmaddubsw is at most
 * 2 * 15 * 127 = 3,810 in size and a block's eight add up to 30,480: they sum exactly in 16
 * bits in any order, widened once per block (the int32 sums, and so the bits, of
 * dot_accumulate's). With all eight unpacked chunks held for the rows at once, the rows'
 * sums went through the stack every block (1.12-1.15x slower). The offsets (the same fused
 * steps in the same block order, so the same sums) take a pass of their own. */
static inline __attribute__((always_inline)) void group_tile_q4_maddubs(
    const uint8_t *codes, const uint16_t *d, const uint16_t *m, int64_t blocks,
    const QuantizedRow *x, int rows, float *sums) {
    const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    __m256 acc[4], offsets[4];
    for (int r = 0; r < 4; r++) acc[r] = offsets[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *block = codes + b * 128;
        prefetch_block_ahead(block, 128);
        __m256i sum16[4];
        for (int r = 0; r < 4; r++) sum16[r] = _mm256_setzero_si256();
        for (int c = 0; c < 4; c++) {
            const __m256i packed = _mm256_loadu_si256((const __m256i *)(block + 32 * c));
            const __m256i lo = _mm256_and_si256(packed, low);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
            for (int r = 0; r < rows; r++) {
                const int32_t *xq = (const int32_t *)(x[r].q + b * QK);
                sum16[r] = _mm256_add_epi16(sum16[r],
                                            _mm256_maddubs_epi16(lo, _mm256_set1_epi32(xq[c])));
                sum16[r] = _mm256_add_epi16(
                    sum16[r], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(xq[c + 4])));
                /* Kept in a register as it stands: otherwise GCC regroups the exact integer
                 * adds, computes every product first and spills them. */
                __asm__("" : "+x"(sum16[r]));
            }
        }
        const __m256 wd = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d + 8 * b)));
        for (int r = 0; r < rows; r++) {
            const __m256 total = _mm256_cvtepi32_ps(_mm256_madd_epi16(sum16[r], ones));
            acc[r] = _mm256_fmadd_ps(total, _mm256_mul_ps(wd, _mm256_set1_ps(x[r].xd[b])), acc[r]);
        }
    }
    for (int64_t b = 0; b < blocks; b++) {
        const __m256 wm = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(m + 8 * b)));
        for (int r = 0; r < rows; r++)
            offsets[r] = _mm256_fmadd_ps(wm, _mm256_set1_ps(x[r].xs[b]), offsets[r]);
    }
    for (int r = 0; r < rows; r++) _mm256_storeu_ps(sums + 8 * r, _mm256_add_ps(acc[r], offsets[r]));
}

/* group_tile for q8 codes without VNNI: signed by signed as |w| by (x with w's sign), each
 * chunk's codes taken by every row in turn (as group_tile_q4_maddubs takes them), each row's
 * int32 sums one register: with all eight chunks held for the rows at once, the rows'
 * scaled sums went through the stack every block. The int32 sums are exact in any order, and
 * the scaling is group_tile's: the same bits. */
static inline __attribute__((always_inline)) void group_tile_q8_maddubs(
    const uint8_t *codes, const uint16_t *d, int64_t blocks, const QuantizedRow *x, int rows,
    float *sums) {
    __m256 acc[4];
    for (int r = 0; r < 4; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *block = codes + b * 256;
        prefetch_block_ahead(block, 256);
        __m256i sum32[4];
        for (int r = 0; r < 4; r++) sum32[r] = _mm256_setzero_si256();
        for (int c = 0; c < 8; c++) {
            const __m256i signs = _mm256_loadu_si256((const __m256i *)(block + 32 * c));
            const __m256i magnitudes = _mm256_sign_epi8(signs, signs);
            for (int r = 0; r < rows; r++) {
                const int32_t *xq = (const int32_t *)(x[r].q + b * QK);
                const __m256i signed_x = _mm256_sign_epi8(_mm256_set1_epi32(xq[c]), signs);
                sum32[r] = dot_accumulate(sum32[r], magnitudes, signed_x);
                __asm__("" : "+x"(sum32[r])); /* as group_tile_q4_maddubs's */
            }
        }
        const __m256 wd = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d + 8 * b)));
        for (int r = 0; r < rows; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum32[r]),
                                     _mm256_mul_ps(wd, _mm256_set1_ps(x[r].xd[b])), acc[r]);
    }
    for (int r = 0; r < rows; r++) _mm256_storeu_ps(sums + 8 * r, acc[r]);
}
#endif

#if !defined(FORKLIFT_PAIRED_GROUPS)
/* Without the paired kernels, a precise q8 weight (the LM head) takes each activation row
 * as one wide row of sixteen-bit codes, the codes of quant_matmul_avx512.h's
 * quantize_wide_row (q = round(x / d), d = max |x| / WIDE_Q8_CODE_MAX), stored as int16:
 * block b's 32 codes at row.q + 64 b. One vpmaddwd multiplies them by the weight's codes
 * widened to 16 bits: two instructions a row for 32 products where two int8 rows took six
 * (a batch-32 decode step spent 30% of its time in the LM head), and the same int32 sums
 * and scaling as the paired kernels' wide rows. */
#define FORKLIFT_WIDE_Q8_DOTS 1

#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("fp-contract=off")))
#endif
static inline void quantize_wide_q8_row(const float *x, int64_t k, QuantizedRow row) {
    for (int64_t b = 0; b < k / QK; b++) {
        __m256i q[4];
        const float d = round_block_avx2(x + b * QK, WIDE_Q8_CODE_MAX, q);
        /* packs interleave the halves of each pair of vectors: 64-bit lanes 0, 2, 1, 3 */
        for (int c = 0; c < 4; c += 2)
            _mm256_storeu_si256((__m256i *)(row.q + 2 * b * QK + 2 * 8 * c),
                                _mm256_permute4x64_epi64(_mm256_packs_epi32(q[c], q[c + 1]),
                                                         0xd8));
        row.xd[b] = d;
        row.xs[b] = 0.0f;
        row.offset[b] = 0;
    }
}

/* group_tile for a q8 weight against wide rows. Chunk c's lower sixteen codes (outputs
 * 0-3, four inputs each) and upper sixteen (outputs 4-7) widen to 16 bits; one broadcast of
 * a row's four codes for those inputs multiplies both, each output's two 32-bit lanes then
 * added at the block's end (vphaddd: lanes for outputs 0, 1, 4, 5, 2, 3, 6, 7, the
 * scales permuted alike and the sums put back in order once). */
static inline __attribute__((always_inline)) void group_tile_q8_wide(
    const uint8_t *codes, const uint16_t *d, int64_t blocks, const QuantizedRow *x, int rows,
    float *sums) {
    const __m256i order = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7); /* its own inverse */
    __m256 acc[4];
    for (int r = 0; r < 4; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *block = codes + b * 256;
        prefetch_block_ahead(block, 256);
        __m256i low[4], high[4];
        for (int r = 0; r < 4; r++) low[r] = high[r] = _mm256_setzero_si256();
        for (int c = 0; c < 8; c++) {
            const __m256i w_low =
                _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(block + 32 * c)));
            const __m256i w_high =
                _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(block + 32 * c + 16)));
            for (int r = 0; r < rows; r++) {
                int64_t four;
                memcpy(&four, x[r].q + 2 * (b * QK + 4 * c), sizeof four);
                const __m256i xv = _mm256_set1_epi64x(four);
                low[r] = _mm256_add_epi32(low[r], _mm256_madd_epi16(w_low, xv));
                high[r] = _mm256_add_epi32(high[r], _mm256_madd_epi16(w_high, xv));
                /* Kept in registers as they stand: otherwise GCC regroups the exact integer
                 * adds, computes every product of the block first and spills them (the head
                 * 1.4-1.8x slower at 4-32 rows). */
                __asm__("" : "+x"(low[r]), "+x"(high[r]));
            }
        }
        const __m256 wd = _mm256_permutevar8x32_ps(
            _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d + 8 * b))), order);
        for (int r = 0; r < rows; r++) {
            const __m256 total = _mm256_cvtepi32_ps(_mm256_hadd_epi32(low[r], high[r]));
            acc[r] = _mm256_fmadd_ps(total, _mm256_mul_ps(wd, _mm256_set1_ps(x[r].xd[b])), acc[r]);
        }
    }
    for (int r = 0; r < rows; r++)
        _mm256_storeu_ps(sums + 8 * r, _mm256_permutevar8x32_ps(acc[r], order));
}
#endif

/* Eight output rows (one row group) against `rows` activation rows, at most 4 at a time
 * so the sums stay in registers; sums[r * 8 + i] receives row group lane i. */
static inline __attribute__((always_inline)) void group_tile(
    const uint8_t *codes, const uint16_t *d, const uint16_t *m, int64_t blocks,
    const QuantizedRow *x, int rows, float *sums, int is_q4) {
#if !defined(FORKLIFT_HAS_VNNI_256)
    if (is_q4)
        group_tile_q4_maddubs(codes, d, m, blocks, x, rows, sums);
    else
        group_tile_q8_maddubs(codes, d, blocks, x, rows, sums);
#else
    const int64_t block_bytes = is_q4 ? 128 : 256;
    /* Two sums per row (scaled dots, q4 offsets): two short dependency chains, not one. */
    __m256 acc[4], offsets[4];
    for (int r = 0; r < 4; r++) acc[r] = offsets[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *block = codes + b * block_bytes;
        prefetch_block_ahead(block, block_bytes);
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
#endif
}

#if !defined(FORKLIFT_ISA_AVX512) /* quant_matmul_avx512.h has a 512-bit form */
/* quantize_row on AVX2 (quant_matmul_plain.h's rule), a block of 32 as four vectors
 * (round_block_avx2), the codes' sums exact integers in any order: the same codes, scales
 * and sums bit for bit, where one value at a time they took a twentieth of an AVX2 CPU's
 * prefill. */
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("fp-contract=off")))
#endif
static inline void quantize_row(const float *x, int64_t k, QuantizedRow row) {
    /* packs leave each 128-bit half's groups of four codes in the order 0, 2, 4, 6 |
     * 1, 3, 5, 7 of the block's eight groups: this puts them back in order. */
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t b = 0; b < k / QK; b++) {
        __m256i q[4];
        const float d = round_block_avx2(x + b * QK, 127.0f, q);
        const __m256i codes = _mm256_permutevar8x32_epi32(
            _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])),
            order);
        _mm256_storeu_si256((__m256i *)(row.q + b * QK), codes);
        const __m256i total =
            _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        __m128i sum4 = _mm_add_epi32(_mm256_castsi256_si128(total),
                                     _mm256_extracti128_si256(total, 1));
        sum4 = _mm_add_epi32(sum4, _mm_shuffle_epi32(sum4, 0x4e));
        sum4 = _mm_add_epi32(sum4, _mm_shuffle_epi32(sum4, 0xb1));
        const int32_t sum = _mm_cvtsi128_si32(sum4);
        row.xd[b] = d;
        row.xs[b] = d * (float)sum;
        row.offset[b] = 128 * sum;
    }
}
#endif

#endif
