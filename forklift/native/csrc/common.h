/* What every kernel here shares: bf16 and fp16 conversions; AMX's grant and tile
 * configuration. */
#ifndef FORKLIFT_COMMON_H
#define FORKLIFT_COMMON_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <unistd.h>

/* Linux hands out AMX's tile data state only on request (arch_prctl, XFEATURE_XTILEDATA);
 * 1 once this process has it. */
static inline int amx_tiles_granted(void) {
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
}

/* ldtilecfg's 64-byte operand: palette 1, then per tile its bytes per row and rows. */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed, aligned(64))) AmxTileConfig;
_Static_assert(sizeof(AmxTileConfig) == 64, "ldtilecfg reads 64 bytes");
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

/* Value i of a tensor in the model's dtype: bf16, or fp32. */
static inline float dtype_value(const void *base, int64_t i, int is_bf16) {
    return is_bf16 ? bf16_to_float(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

static inline void store_value(void *base, int64_t i, float v, int is_bf16) {
    if (is_bf16)
        ((uint16_t *)base)[i] = float_to_bf16(v);
    else
        ((float *)base)[i] = v;
}

#if defined(__AVX512BF16__)
/* n floats rounded to bf16 (nearest even), 32 a vector instruction, the rest one by one. */
static inline void round_to_bf16(const float *src, int64_t n, uint16_t *dst) {
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        const __m512 low = _mm512_loadu_ps(src + i), high = _mm512_loadu_ps(src + i + 16);
        _mm512_storeu_si512(dst + i, (__m512i)_mm512_cvtne2ps_pbh(high, low));
    }
    for (; i < n; i++) dst[i] = float_to_bf16(src[i]);
}
#endif

static inline float fp16_to_float(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
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
#endif
}

#endif
