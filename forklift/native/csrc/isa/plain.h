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


/* n floats copied (a quantized matmul's group of sums). */
static inline void copy_floats(float *dst, const float *src, int64_t n) {
    memcpy(dst, src, sizeof(float) * (size_t)n);
}

#endif
