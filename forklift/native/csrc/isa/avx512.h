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
