/* The quantized matmul's AVX-512 kernels (quant_matmul.h has the layout): activation rows
 * quantized sixteen values a vector, and with VNNI (FORKLIFT_PAIRED_GROUPS) two row groups
 * at once in 512-bit registers, whose unpacked blocks and scaling the AMX-INT8 tiles
 * (quant_matmul_amx.h) share. */
#ifndef FORKLIFT_QUANT_MATMUL_AVX512_H
#define FORKLIFT_QUANT_MATMUL_AVX512_H

/* Block b of x times its scale's reciprocal `inverse` (broadcast; 0 for a block of zeros or
 * of values so small that the reciprocal would overflow), rounded to integers: values
 * 0-15 into q[0], 16-31 into q[1]. Not contracted: x * inverse is rounded before the
 * rounding constant is added (GCC's vector intrinsics are plain arithmetic to it, fused
 * across statements unless told). */
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("fp-contract=off")))
#endif
static inline __attribute__((always_inline)) void round_block(const float *x, int64_t b,
                                                              __m512 inverse, __m512i q[2]) {
    const __m512 magic = _mm512_set1_ps(12582912.0f);
    for (int half = 0; half < 2; half++) {
        const __m512 v = _mm512_loadu_ps(x + b * QK + 16 * half);
        q[half] = _mm512_cvttps_epi32(
            _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(v, inverse), magic), magic));
    }
}

/* Block b of a row quantized with `inverse` (round_block): its codes into the row, and
 * sixteen lanes of their integer sums. */
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("fp-contract=off")))
#endif
static inline __attribute__((always_inline)) __m512i quantize_block(
    const float *x, int64_t b, __m512 inverse, QuantizedRow row) {
    __m512i q[2];
    round_block(x, b, inverse, q);
    const __m512i q_lo = q[0], q_hi = q[1];
    _mm_storeu_si128((__m128i *)(row.q + b * QK), _mm512_cvtepi32_epi8(q_lo));
    _mm_storeu_si128((__m128i *)(row.q + b * QK + 16), _mm512_cvtepi32_epi8(q_hi));
    return _mm512_add_epi32(q_lo, q_hi);
}

/* The largest magnitude of block b, in each of sixteen lanes (not yet combined). */
static inline __m512 block_magnitudes(const float *x, int64_t b) {
    return _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x + b * QK)),
                         _mm512_abs_ps(_mm512_loadu_ps(x + b * QK + 16)));
}

/* quantize_row's work on AVX-512, each block of 32 as two vectors: the same operations on
 * the same values (the largest magnitude, one division, one reciprocal, a product rounded
 * before the rounding constant is added; codes' sums are exact integers in any order), so
 * the same codes, scales and sums bit for bit; a prefill chunk spent a tenth of its time
 * quantizing rows one value at a time. Sixteen blocks at a time share the horizontal work:
 * their maxima and sums combined as the lanes of one vector (combine16; the sums as floats,
 * exact for these small integers), their scales and reciprocals one vector division each. */
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("fp-contract=off")))
#endif
static inline void quantize_row_vectors(const float *x, int64_t k, QuantizedRow row) {
    const int64_t blocks = k / QK;
    int64_t b = 0;
    for (; b + 16 <= blocks; b += 16) {
        float16_vector parts[16];
        for (int p = 0; p < 16; p++) parts[p] = (float16_vector)block_magnitudes(x, b + p);
        const __m512 d = _mm512_div_ps((__m512)combine16(parts, 1), _mm512_set1_ps(127.0f));
        const __mmask16 positive = _mm512_cmp_ps_mask(d, _mm512_setzero_ps(), _CMP_GT_OQ);
        const __m512 reciprocal = _mm512_maskz_div_ps(positive, _mm512_set1_ps(1.0f), d);
        /* block_inverse's rule: a denormal scale's reciprocal overflows, its codes are 0 */
        const __m512 inverse = _mm512_maskz_mov_ps(
            _mm512_cmp_ps_mask(reciprocal, _mm512_set1_ps(INFINITY), _CMP_LT_OQ), reciprocal);
        for (int p = 0; p < 16; p++)
            parts[p] = (float16_vector)_mm512_cvtepi32_ps(quantize_block(
                x, b + p, _mm512_permutexvar_ps(_mm512_set1_epi32(p), inverse), row));
        const __m512 sums = (__m512)combine16(parts, 0);
        _mm512_storeu_ps(row.xd + b, d);
        _mm512_storeu_ps(row.xs + b, _mm512_mul_ps(d, sums));
        _mm512_storeu_si512(row.offset + b,
                            _mm512_slli_epi32(_mm512_cvttps_epi32(sums), 7)); /* 128 x sum */
    }
    for (; b < blocks; b++) {
        const float amax = _mm512_reduce_max_ps(block_magnitudes(x, b));
        const float d = amax / 127.0f;
        const __m512 inverse = _mm512_set1_ps(block_inverse(d));
        const int32_t sum = _mm512_reduce_add_epi32(quantize_block(x, b, inverse, row));
        row.xd[b] = d;
        row.xs[b] = d * (float)sum;
        row.offset[b] = 128 * sum;
    }
}

/* quantize_row on AVX-512: quantize_row_vectors, not contracted either (as the plain
 * form, quant_matmul_plain.h). */
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("fp-contract=off")))
#endif
static inline void quantize_row(const float *x, int64_t k, QuantizedRow row) {
    quantize_row_vectors(x, k, row);
}

#if defined(FORKLIFT_PAIRED_GROUPS)
#define PAIR_TILE_ROWS 8

/* Block b's wide codes q = round(x / d) into q[0] (values 0-15) and q[1] (16-31); returns
 * d = max |x| / code_max. Both wide forms round here, so they hold the same codes. */
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("fp-contract=off")))
#endif
static inline __attribute__((always_inline)) float round_wide_block(const float *x, int64_t b,
                                                                    float code_max,
                                                                    __m512i q[2]) {
    const float d = _mm512_reduce_max_ps(block_magnitudes(x, b)) / code_max;
    round_block(x, b, _mm512_set1_ps(block_inverse(d)), q);
    return d;
}

/* A row's integer sums against its codes' high and low parts joined: 256 times the first
 * plus the second, sum(w q) for sixteen-bit codes q = 256 h + l. */
static inline __m512i join_high_low(__m512i high, __m512i low) {
    return _mm512_add_epi32(_mm512_slli_epi32(high, 8), low);
}

/* Wide rows (a precise weight's activation rows, whose input carries the outliers that int8
 * rounds to nothing): each block of 32 quantized to more than eight bits, q = round(x / d),
 * and stored as two bytes a value, block b's 64 codes at row.q + 64 b: the high parts
 * h = q >> shift (signed), then the low ones l = q & (2^shift - 1) (unsigned).
 * - q4 weights (the MLP's down projection): twelve bits, shift 4. With the weights' codes c
 *   taken as 16 c against h and c against l, one integer dot product of 64 bytes is sum c q
 *   exactly, whatever multiplies it (group_pair_tile, group_pair_tiles); xs[b] = d * sum(q)
 *   (the mins' term).
 * - q8 weights (the LM head): sixteen bits, shift 8. Codes -127..127 times 256 leave a
 *   byte, so h and l take a dot product each, 256 sum(w h) + sum(w l) = sum w q exactly;
 *   offset[b] = 32768 * sum(h), what the dot products' unsigned codes w + 128 add to the
 *   first times 256.
 * Not contracted, as quantize_row. */
#define WIDE_Q4_SHIFT 4
#define WIDE_Q8_SHIFT 8

#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("fp-contract=off")))
#endif
static inline void quantize_wide_row(const float *x, int64_t k, QuantizedRow row, int is_q4) {
    const int shift = is_q4 ? WIDE_Q4_SHIFT : WIDE_Q8_SHIFT;
    const float code_max = is_q4 ? 2047.0f : WIDE_Q8_CODE_MAX;
    const __m512i low_bits = _mm512_set1_epi32((1 << shift) - 1);
    for (int64_t b = 0; b < k / QK; b++) {
        __m512i q[2];
        const float d = round_wide_block(x, b, code_max, q);
        const __m512i high[2] = {_mm512_srai_epi32(q[0], shift), _mm512_srai_epi32(q[1], shift)};
        int8_t *codes = row.q + 2 * b * QK;
        _mm_storeu_si128((__m128i *)codes, _mm512_cvtepi32_epi8(high[0]));
        _mm_storeu_si128((__m128i *)(codes + 16), _mm512_cvtepi32_epi8(high[1]));
        _mm_storeu_si128((__m128i *)(codes + 32),
                         _mm512_cvtepi32_epi8(_mm512_and_si512(q[0], low_bits)));
        _mm_storeu_si128((__m128i *)(codes + 48),
                         _mm512_cvtepi32_epi8(_mm512_and_si512(q[1], low_bits)));
        row.xd[b] = d;
        if (is_q4) {
            const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q[0], q[1]));
            row.xs[b] = d * (float)sum;
            row.offset[b] = 0;
        } else {
            row.xs[b] = 0.0f;
            row.offset[b] = 32768 * _mm512_reduce_add_epi32(_mm512_add_epi32(high[0], high[1]));
        }
    }
}

/* A q8 weight's wide row (the same codes q as quantize_wide_row's) as two int8 rows, for a
 * tile of eight rows (group_pair_tiles' pairs): `high` takes h = (q + 128) >> 8 and `low`
 * l = q - 256 h, both signed bytes, so that 256 h + l = q; both rows' offset[b] is
 * 128 * sum(q) (the unsigned codes' surplus of 256 h + l), their xd the block's scale. */
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("fp-contract=off")))
#endif
static inline void quantize_paired_row(const float *x, int64_t k, QuantizedRow high,
                                       QuantizedRow low) {
    for (int64_t b = 0; b < k / QK; b++) {
        __m512i q[2];
        const float d = round_wide_block(x, b, WIDE_Q8_CODE_MAX, q);
        for (int half = 0; half < 2; half++) {
            const __m512i rounded = _mm512_add_epi32(q[half], _mm512_set1_epi32(128));
            const __m512i h = _mm512_srai_epi32(rounded, 8);
            const __m512i l = _mm512_sub_epi32(q[half], _mm512_slli_epi32(h, 8));
            _mm_storeu_si128((__m128i *)(high.q + b * QK + 16 * half), _mm512_cvtepi32_epi8(h));
            _mm_storeu_si128((__m128i *)(low.q + b * QK + 16 * half), _mm512_cvtepi32_epi8(l));
        }
        const int32_t offset = 128 * _mm512_reduce_add_epi32(_mm512_add_epi32(q[0], q[1]));
        high.xd[b] = low.xd[b] = d;
        high.xs[b] = low.xs[b] = 0.0f;
        high.offset[b] = low.offset[b] = offset;
    }
}

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
        __builtin_prefetch(first + PREFETCH_BLOCKS * block_bytes + line, 0, PREFETCH_LOCALITY);
        __builtin_prefetch(second + PREFETCH_BLOCKS * block_bytes + line, 0, PREFETCH_LOCALITY);
    }
    unpack_pair_block(first, second, is_q4, w);
}

/* Block b of groups g and g + 1 unpacked as fetch_pair_block does, stored as the tiles read
 * it: 512 bytes at `dst`; `wide` (q4 against wide rows): 1 KB, the codes times 16 (each
 * stays in its byte) and then the codes, against the rows' high and low parts. */
static inline __attribute__((always_inline)) void store_pair_block(
    const uint8_t *codes0, const uint8_t *codes1, int64_t b, int is_q4, int wide,
    uint8_t *dst) {
    __m512i w[8];
    fetch_pair_block(codes0, codes1, b, is_q4, w);
    for (int c = 0; c < 8; c++) {
        if (wide) _mm512_store_si512(dst + 64 * c, _mm512_slli_epi16(w[c], 4));
        _mm512_store_si512(dst + 64 * (wide ? 8 + c : c), w[c]);
    }
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
    float *sums, int is_q4, int wide) {
    __m512 acc[PAIR_TILE_ROWS];
    for (int r = 0; r < PAIR_TILE_ROWS; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        __m512i w[8], w16[8];
        fetch_pair_block(codes0, codes1, b, is_q4, w);
        if (wide && is_q4) /* wide rows (quantize_wide_row): 16 c against their high parts */
            for (int c = 0; c < 8; c++) w16[c] = _mm512_slli_epi16(w[c], 4);
        if (wide && !is_q4) /* q8: the signed codes, against the low parts */
            for (int c = 0; c < 8; c++)
                w16[c] = _mm512_xor_si512(w[c], _mm512_set1_epi8((char)0x80));
        const __m512 wd = pair_scales(d0, d1, b);
        const __m512 wm = is_q4 ? pair_scales(m0, m1, b) : _mm512_setzero_ps();
        for (int r = 0; r < rows; r++) {
            const int32_t *xq = (const int32_t *)(x[r].q + b * QK * (wide ? 2 : 1));
            __m512i even = _mm512_setzero_si512(), odd = _mm512_setzero_si512();
            if (wide && !is_q4) { /* 256 sum((w + 128) h) + sum(l w); offset: the surplus */
                __m512i high = _mm512_setzero_si512(), low = _mm512_setzero_si512();
                for (int c = 0; c < 8; c++) {
                    high = _mm512_dpbusd_epi32(high, w[c], _mm512_set1_epi32(xq[c]));
                    low = _mm512_dpbusd_epi32(low, _mm512_set1_epi32(xq[8 + c]), w16[c]);
                }
                acc[r] = scale_block_sums(acc[r], join_high_low(high, low), wd, wm, x[r].xd + b,
                                          x[r].xs + b, x[r].offset + b, 0);
                continue;
            }
            for (int c = 0; c < 8; c += 2) {
                if (wide) {
                    even = _mm512_dpbusd_epi32(even, w16[c], _mm512_set1_epi32(xq[c]));
                    odd = _mm512_dpbusd_epi32(odd, w16[c + 1], _mm512_set1_epi32(xq[c + 1]));
                    even = _mm512_dpbusd_epi32(even, w[c], _mm512_set1_epi32(xq[8 + c]));
                    odd = _mm512_dpbusd_epi32(odd, w[c + 1], _mm512_set1_epi32(xq[9 + c]));
                    continue;
                }
                even = _mm512_dpbusd_epi32(even, w[c], _mm512_set1_epi32(xq[c]));
                odd = _mm512_dpbusd_epi32(odd, w[c + 1], _mm512_set1_epi32(xq[c + 1]));
            }
            acc[r] = scale_block_sums(acc[r], _mm512_add_epi32(even, odd), wd, wm, x[r].xd + b,
                                      x[r].xs + b, x[r].offset + b, is_q4);
        }
    }
    for (int r = 0; r < rows; r++) _mm512_storeu_ps(sums + 16 * r, acc[r]);
}
#endif

#endif
