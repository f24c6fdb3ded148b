/* The quantized matmul's kernels in plain C (quant_matmul.h has the layout), for what this
 * build's instruction set has no kernel of its own: activation rows quantized a value at a
 * time below AVX2, eight-output groups below AVX2. Each gives its vector forms' results
 * bit for bit. */
#ifndef FORKLIFT_QUANT_MATMUL_PLAIN_H
#define FORKLIFT_QUANT_MATMUL_PLAIN_H

#if !defined(FORKLIFT_ISA_AVX512) && !defined(FORKLIFT_ISA_AVX2)
/* Row x's blocks into `row` (codes, scales, sums), one value at a time. No fused
 * multiply-add in here: rounding x * inverse before adding the rounding constant is what
 * keeps the codes those of a plain round(x / d) (clang fuses only within one expression,
 * GCC across statements unless told). */
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("fp-contract=off")))
#endif
static inline void quantize_row(const float *x, int64_t k, QuantizedRow row) {
    for (int64_t b = 0; b < k / QK; b++) {
        const float *xb = x + b * QK;
        float amax = 0.0f;
        for (int i = 0; i < QK; i++) {
            const float a = fabsf(xb[i]);
            amax = a > amax ? a : amax;
        }
        const float d = amax / 127.0f;
        const float inverse = block_inverse(d);
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
}
#endif

#if !defined(FORKLIFT_ISA_AVX2)
/* Eight output rows (one row group) against `rows` activation rows, at most 4 at a time
 * so the sums stay in registers; sums[r * 8 + i] receives row group lane i. */
static inline __attribute__((always_inline)) void group_tile(
    const uint8_t *codes, const uint16_t *d, const uint16_t *m, int64_t blocks,
    const QuantizedRow *x, int rows, float *sums, int is_q4) {
    const int64_t block_bytes = is_q4 ? 128 : 256;
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
}
#endif

#endif
