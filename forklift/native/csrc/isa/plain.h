/* The operations' vector helpers in plain C, for targets below AVX2 (x86-64 v1/v2, other
 * architectures): the same names avx2.h and avx512.h define, with the same results, left
 * to the compiler's own vectoriser. */
#ifndef FORKLIFT_ISA_PLAIN_H
#define FORKLIFT_ISA_PLAIN_H

#include <string.h>

/* Sixteen int8 values widened to fp32. */
static inline float16_vector widen_int8(const int8_t *src) {
    int8_16_vector raw;
    memcpy(&raw, src, sizeof raw);
    return __builtin_convertvector(raw, float16_vector);
}

/* Eight bf16 values widened to fp32 (a zero extension and a shift). */
static inline float8_vector widen8_bf16(const uint16_t *src) {
    uint16_t raw __attribute__((vector_size(16)));
    memcpy(&raw, src, sizeof raw);
    typedef int32_t int8_lanes __attribute__((vector_size(32)));
    return (float8_vector)(__builtin_convertvector(raw, int8_lanes) << 16);
}

/* n floats copied (a quantized matmul's group of sums). */
static inline void copy_floats(float *dst, const float *src, int64_t n) {
    memcpy(dst, src, sizeof(float) * (size_t)n);
}

#endif
