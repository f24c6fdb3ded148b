/* The operations' vector helpers on AVX-512 (F, BW, VL; VNNI and BF16 where the target has
 * them), 512-bit registers: sixteen floats widened or rounded in one instruction. Includes
 * avx2.h for the 256-bit forms the operations keep. */
#ifndef FORKLIFT_ISA_AVX512_H
#define FORKLIFT_ISA_AVX512_H

#include "avx2.h"

/* Sixteen int8 values widened to fp32: one sign extension and one conversion. */
static inline float16_vector widen_int8(const int8_t *src) {
    const __m512i wide = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)src));
    return (float16_vector)_mm512_cvtepi32_ps(wide);
}

/* Sixteen fp8 codes widened to fp32 through their fp16 bits (e5m2: fp16's upper byte; e4m3's
 * exponent and mantissa shifted into fp16's, worth 2^-8 of its value), built in one
 * register and converted by one vcvtph2ps. */
static inline float16_vector widen_fp8(const uint8_t *src, int e5m2) {
    const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)src));
    const __m256i half = e5m2
        ? _mm256_slli_epi16(bytes, 8)
        : _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(bytes, _mm256_set1_epi16(0x80)), 8),
                          _mm256_slli_epi16(_mm256_and_si256(bytes, _mm256_set1_epi16(0x7f)), 7));
    return (float16_vector)_mm512_cvtph_ps(half);
}

/* Lane p of the result: a[p]'s sixteen lanes added (is_max 0) or their largest (1): four
 * levels of shuffles serve all sixteen vectors. Each vector's lanes combine in one fixed
 * order, whatever its slot. */
static inline __attribute__((always_inline)) float16_vector combine16(const float16_vector a[16],
                                                                     int is_max) {
#define COMBINE(x, y) (is_max ? (float16_vector)_mm512_max_ps((__m512)(x), (__m512)(y)) : (x) + (y))
    float16_vector halves[8], quarters[4], pairs[2];
    for (int i = 0; i < 8; i++) /* lanes 0-7: a[2i]'s two halves combined; 8-15: a[2i + 1]'s */
        halves[i] = COMBINE(SHUFFLE2(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18,
                                     19, 20, 21, 22, 23),
                            SHUFFLE2(a[2 * i], a[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24,
                                     25, 26, 27, 28, 29, 30, 31));
    for (int i = 0; i < 4; i++) /* four lanes each of a[4i] .. a[4i + 3] */
        quarters[i] = COMBINE(SHUFFLE2(halves[2 * i], halves[2 * i + 1], 0, 1, 2, 3, 8, 9, 10,
                                       11, 16, 17, 18, 19, 24, 25, 26, 27),
                              SHUFFLE2(halves[2 * i], halves[2 * i + 1], 4, 5, 6, 7, 12, 13,
                                       14, 15, 20, 21, 22, 23, 28, 29, 30, 31));
    for (int i = 0; i < 2; i++) /* two lanes each of a[8i] .. a[8i + 7] */
        pairs[i] = COMBINE(SHUFFLE2(quarters[2 * i], quarters[2 * i + 1], 0, 1, 4, 5, 8, 9, 12,
                                    13, 16, 17, 20, 21, 24, 25, 28, 29),
                           SHUFFLE2(quarters[2 * i], quarters[2 * i + 1], 2, 3, 6, 7, 10, 11,
                                    14, 15, 18, 19, 22, 23, 26, 27, 30, 31));
    return COMBINE(SHUFFLE2(pairs[0], pairs[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24,
                            26, 28, 30),
                   SHUFFLE2(pairs[0], pairs[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25,
                            27, 29, 31));
#undef COMBINE
}

#if defined(FORKLIFT_HAS_AVX512_BF16)
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

#endif
