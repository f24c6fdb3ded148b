/* What every instruction set shares (included by isa.h before the set's own header): the
 * GCC / clang vector-extension types the operations' element-wise code is written in (the
 * compiler lowers them to whatever registers the target has), the lane vectors of LANES
 * floats, and the scalar bf16 conversions each header's vector forms agree with. */
#ifndef FORKLIFT_ISA_PORTABLE_H
#define FORKLIFT_ISA_PORTABLE_H

#include <stdint.h>
#include <string.h>

/* Sixteen floats as one vector (GCC and clang vector extensions; the compiler splits it
 * into two halves on AVX2). */
typedef float float16_vector __attribute__((vector_size(64)));
typedef int32_t int16_vector __attribute__((vector_size(64)));
#if defined(__clang__)
#define SHUFFLE(v, ...) __builtin_shufflevector(v, v, __VA_ARGS__)
#define SHUFFLE2(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE(v, ...) __builtin_shuffle(v, (int16_vector){__VA_ARGS__})
#define SHUFFLE2(a, b, ...) __builtin_shuffle(a, b, (int16_vector){__VA_ARGS__})
#endif

typedef uint16_t uint16_16_vector __attribute__((vector_size(32)));
typedef int8_t int8_16_vector __attribute__((vector_size(16)));

/* Eight floats: a width every x86-64-v3 CPU holds in one register (GCC lowers wider
 * generic vectors through memory there). */
typedef float float8_vector __attribute__((vector_size(32)));

/* LANES floats (isa.h), the element-wise loops' vector. */
typedef float lane_vector __attribute__((vector_size(4 * LANES)));
typedef int32_t lane_int_vector __attribute__((vector_size(4 * LANES)));
#if defined(__clang__)
#define LANE_SHUFFLE(v, ...) __builtin_shufflevector(v, v, __VA_ARGS__)
#else
#define LANE_SHUFFLE(v, ...) __builtin_shuffle(v, (lane_int_vector){__VA_ARGS__})
#endif

static inline float bf16_to_float(uint16_t bits) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)bits << 16;
    return v.f;
}

static inline uint16_t float_to_bf16(float x) {
    union { uint32_t u; float f; } v;
    v.f = x;
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40u); /* NaN */
    v.u += 0x7fffu + ((v.u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(v.u >> 16);
}


#if defined(FORKLIFT_HAS_F16C)
/* fp16 to fp32: F16C's conversion wherever the target has it (every AVX2 build; Ivy
 * Bridge), else in plain C with the same results. */
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

#endif
