/* The value pass of decode attention on CPUs with AVX512_BF16: `vdpbf16ps` multiplies bf16
 * pairs and adds both products into fp32 lanes, so two cache positions go in one
 * instruction without widening either row.
 *
 * Two value rows are interleaved (16-bit unpacks) so each 32-bit lane holds one dimension of
 * both, and each query vector's two weights (softmax numerators, rounded to bf16 as PyTorch's
 * bf16 attention rounds its probabilities) are one broadcast 32-bit pair. The sums come out
 * in the unpacks' lane order and are put back in dimension order once at the end. Every
 * query vector's sums are taken over the same pairs in the same order whoever shares its
 * task, so a row's result still never depends on the rows beside it.
 */
#ifndef FORKLIFT_ATTENTION_BF16_H
#define FORKLIFT_ATTENTION_BF16_H

#if defined(__AVX512BF16__)
#include <immintrin.h>

#include "common.h"

#define HAS_BF16_VALUE_PASS 1

/* Each vector's weights of the live positions as bf16 pairs: pairs[j * num_pairs + i] holds
 * position live[2i] in its low half and live[2i + 1] (0 past the end) in its high half. */
static inline void pair_weights_bf16(uint32_t *pairs, const float *scores, const int64_t *live,
                                     int64_t num_live, int64_t width, int64_t count) {
    const int64_t num_pairs = (num_live + 1) / 2;
    for (int64_t j = 0; j < count; j++) {
        const float *sj = scores + j * width;
        uint32_t *pj = pairs + j * num_pairs;
        for (int64_t i = 0; i < num_pairs; i++) {
            const uint32_t low = float_to_bf16(sj[live[2 * i]]);
            const uint32_t high = 2 * i + 1 < num_live ? float_to_bf16(sj[live[2 * i + 1]]) : 0u;
            pj[i] = low | (high << 16);
        }
    }
}

/* acc[j] = sum_t p[j, t] V[t] for query vectors j in [first, first + pass): head_dim (a
 * multiple of 32) and pass are constants at each call site once inlined, so the sums,
 * 2 * head_dim / 32 registers a vector, stay in registers. */
static inline __attribute__((always_inline)) void values_bf16_pass(
    float *acc, const uint32_t *pairs, const uint16_t *v_head, const int64_t *slots,
    const int64_t *live, int64_t num_live, int64_t first, int64_t head_dim, int64_t pass) {
    const int64_t num_pairs = (num_live + 1) / 2, chunks = head_dim / 32;
    __m512 low_sums[4][4], high_sums[4][4];
    for (int64_t h = 0; h < pass; h++)
        for (int64_t c = 0; c < chunks; c++) low_sums[h][c] = high_sums[h][c] = _mm512_setzero_ps();
    for (int64_t i = 0; i < num_pairs; i++) {
        const int64_t second = 2 * i + 1 < num_live ? 2 * i + 1 : 2 * i;
        const uint16_t *a = v_head + slots[live[2 * i]] * head_dim;
        const uint16_t *b = v_head + slots[live[second]] * head_dim;
        if (2 * i + PREFETCH_AHEAD + 1 < num_live) {
            prefetch_row((const char *)v_head, slots[live[2 * i + PREFETCH_AHEAD]],
                         (size_t)head_dim * 2);
            prefetch_row((const char *)v_head, slots[live[2 * i + PREFETCH_AHEAD + 1]],
                         (size_t)head_dim * 2);
        }
        __m512i low[4], high[4];
        for (int64_t c = 0; c < chunks; c++) {
            const __m512i ra = _mm512_loadu_si512(a + 32 * c);
            const __m512i rb = _mm512_loadu_si512(b + 32 * c);
            low[c] = _mm512_unpacklo_epi16(ra, rb);
            high[c] = _mm512_unpackhi_epi16(ra, rb);
        }
        for (int64_t h = 0; h < pass; h++) {
            const __m512bh w = (__m512bh)_mm512_set1_epi32((int)pairs[(first + h) * num_pairs + i]);
            for (int64_t c = 0; c < chunks; c++) {
                low_sums[h][c] = _mm512_dpbf16_ps(low_sums[h][c], (__m512bh)low[c], w);
                high_sums[h][c] = _mm512_dpbf16_ps(high_sums[h][c], (__m512bh)high[c], w);
            }
        }
    }
    /* Lane 4L + k of a chunk's low sums is dimension 8L + k, of its high sums 8L + 4 + k. */
    const __m512i front = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i back = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29,
                                           30, 31);
    for (int64_t h = 0; h < pass; h++) {
        float *out = acc + (first + h) * head_dim;
        for (int64_t c = 0; c < chunks; c++) {
            _mm512_storeu_ps(out + 32 * c,
                             _mm512_permutex2var_ps(low_sums[h][c], front, high_sums[h][c]));
            _mm512_storeu_ps(out + 32 * c + 16,
                             _mm512_permutex2var_ps(low_sums[h][c], back, high_sums[h][c]));
        }
    }
}

/* Every query vector's value sums, in passes of a constant size: 4 vectors at head size 64,
 * 2 at 128 (16 sum registers), the last pass only as many as are left. */
static inline __attribute__((always_inline)) void accumulate_values_pairs(
    float *acc, const uint32_t *pairs, const uint16_t *v_head, const int64_t *slots,
    const int64_t *live, int64_t num_live, int64_t count, int64_t head_dim) {
    const int64_t per_pass = head_dim == 64 ? 4 : 2;
    for (int64_t first = 0; first < count; first += per_pass) {
        const int64_t left = count - first;
        switch (left >= per_pass ? per_pass : left) {
        case 4:
            values_bf16_pass(acc, pairs, v_head, slots, live, num_live, first, head_dim, 4);
            break;
        case 3:
            values_bf16_pass(acc, pairs, v_head, slots, live, num_live, first, head_dim, 3);
            break;
        case 2:
            values_bf16_pass(acc, pairs, v_head, slots, live, num_live, first, head_dim, 2);
            break;
        default:
            values_bf16_pass(acc, pairs, v_head, slots, live, num_live, first, head_dim, 1);
        }
    }
}

#endif
#endif
