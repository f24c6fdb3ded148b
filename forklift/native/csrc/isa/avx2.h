/* The operations' vector helpers on AVX2 (x86-64-v3: AVX2, FMA, F16C), 256-bit registers.
 * avx512.h builds on it: what has no wider form there (the eight-output int8 dot product)
 * is this header's on AVX-512 too. fp16 scalars convert in portable.h (F16C). */
#ifndef FORKLIFT_ISA_AVX2_H
#define FORKLIFT_ISA_AVX2_H

#include <immintrin.h>

/* acc + the int32 sums of u[4i..4i+3] * s[4i..4i+3] per lane i (unsigned by signed). */
static inline __m256i dot_accumulate(__m256i acc, __m256i u, __m256i s) {
#if defined(FORKLIFT_HAS_VNNI_256)
    return _mm256_dpbusd_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s),
                                                   _mm256_set1_epi16(1)));
#endif
}

/* Eight bf16 values widened to fp32 in one register: a zero extension from memory and a
 * shift (GCC's generic conversion extends each half apart and joins them). */
static inline float8_vector widen8_bf16(const uint16_t *src) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)src));
    const __m256i bits = _mm256_slli_epi32(wide, 16);
    float8_vector out;
    memcpy(&out, &bits, sizeof out);
    return out;
}

/* n floats copied (a quantized matmul's group of sums): a whole group of eight in one load
 * and one store, not a library call per row. */
static inline void copy_floats(float *dst, const float *src, int64_t n) {
    if (n == 8) {
        _mm256_storeu_ps(dst, _mm256_loadu_ps(src));
        return;
    }
    memcpy(dst, src, sizeof(float) * (size_t)n);
}

#if !defined(FORKLIFT_ISA_AVX512) /* avx512.h widens in one register */
/* Sixteen int8 values widened to fp32: a sign extension and a conversion per register
 * (GCC lowers the generic vector conversion to sixteen scalar extensions: 2.5x slower). */
static inline float16_vector widen_int8(const int8_t *src) {
    const __m256 low = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)src)));
    const __m256 high =
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(src + 8))));
    float16_vector out;
    memcpy(&out, &low, sizeof low);
    memcpy((char *)&out + sizeof low, &high, sizeof high);
    return out;
}

#endif

#endif
