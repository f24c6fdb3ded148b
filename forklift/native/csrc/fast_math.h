/* exp and log as plain arithmetic the compiler vectorises inside a loop (libm's expf and
 * logf are a call per element). Written for GCC's vectoriser without -ffast-math: floorf
 * and a float ?: select each keep a loop scalar, so rounding adds and removes 1.5 * 2^23
 * and clamps select by bits. */
#ifndef FORKLIFT_FAST_MATH_H
#define FORKLIFT_FAST_MATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float float_from_bits(uint32_t bits) {
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

static inline uint32_t bits_of_float(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    return bits;
}

/* exp(x) for x <= 0: 2^n * p(r) with x = n ln2 + r, |r| <= ln2 / 2; relative error about
 * 2e-7. Below -87 (-inf included) it gives about 1e-38, not 0: callers that need an exact
 * 0 for -inf test for it. */
static inline float exp_nonpositive(float x) {
    const uint32_t low = 0u - (uint32_t)(x < -87.0f);
    x = float_from_bits((bits_of_float(-87.0f) & low) | (bits_of_float(x) & ~low));
    const float n = (x * 1.44269504f + 12582912.0f) - 12582912.0f;
    const float r = x - n * 0.693145752f - n * 1.42860677e-6f;
    float p = 1.98756912e-4f;
    p = p * r + 1.39819994e-3f;
    p = p * r + 8.33345205e-3f;
    p = p * r + 4.16657962e-2f;
    p = p * r + 1.66666657e-1f;
    p = p * r + 5.0e-1f;
    p = p * r * r + r + 1.0f;
    return p * float_from_bits((uint32_t)((int32_t)n + 127) << 23);
}

/* sigmoid(z) with exp taken of -|z| only (no overflow): 1 / (1 + e) for z >= 0,
 * e / (1 + e) below, e = exp(-|z|); the numerator selected by bits, so loops over it
 * vectorise. */
static inline float sigmoid1(float z) {
    const float e = exp_nonpositive(-fabsf(z));
    const uint32_t below = 0u - (uint32_t)(z < 0.0f);
    const float numerator = float_from_bits((bits_of_float(e) & below) |
                                            (bits_of_float(1.0f) & ~below));
    return numerator / (1.0f + e);
}

/* log(x) for a normal x > 0: x = 2^e m with m in [sqrt(1/2), sqrt(2)), and
 * log(m) = 2 atanh(s) with s = (m - 1) / (m + 1), |s| < 0.172: the odd series to s^9
 * leaves a relative error under 3e-9 (5e-7 absolute in all, measured). */
static inline float log_positive(float x) {
    const uint32_t bits = bits_of_float(x);
    const int32_t e = (int32_t)(bits - 0x3f3504f3u) >> 23; /* 0x3f3504f3: sqrt(1/2) */
    const float m = float_from_bits(bits - ((uint32_t)e << 23));
    const float s = (m - 1.0f) / (m + 1.0f);
    const float s2 = s * s;
    const float series =
        s * (2.0f + s2 * (2.0f / 3 + s2 * (2.0f / 5 + s2 * (2.0f / 7 + s2 * (2.0f / 9)))));
    /* ln 2 split so that e * hi is exact. */
    return (float)e * 0.693145751953125f + (series + (float)e * 1.428606765330187e-6f);
}

#endif
