/* The operations' vector helpers in plain C, for targets below AVX2 (x86-64 v1/v2, other
 * architectures): the same names avx2.h and avx512.h define, with the same results, left
 * to the compiler's own vectoriser. */
#ifndef FORKLIFT_ISA_PLAIN_H
#define FORKLIFT_ISA_PLAIN_H

#include <string.h>

#if defined(FORKLIFT_HAS_F16C)
/* F16C without AVX2 (Ivy Bridge): its conversion, as the wider headers take it. */
#include <immintrin.h>

static inline float fp16_to_float(uint16_t h) { return _cvtsh_ss(h); }
#else
static inline float fp16_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu, bits;
    if (exponent == 0x1fu) {
        bits = sign | 0x7f800000u | (mantissa << 13);
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112u) << 23) | (mantissa << 13);
    } else if (mantissa == 0) {
        bits = sign;
    } else { /* subnormal: renormalise */
        exponent = 113u;
        while (!(mantissa & 0x400u)) {
            mantissa <<= 1;
            exponent--;
        }
        bits = sign | (exponent << 23) | ((mantissa & 0x3ffu) << 13);
    }
    union { uint32_t u; float f; } v;
    v.u = bits;
    return v.f;
}
#endif

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
