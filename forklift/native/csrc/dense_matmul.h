/* Dense bf16 matmuls for the decode step: out[r, n] = sum_k x[r, k] * w[n, k],
 * the weights bf16 as a model's dense layers hold them (RL rollouts push them in every
 * optimizer step).
 *
 * Packed layout (`forklift.native.dense_weights.pack_dense` writes it): for each block of 16
 * outputs j and 32 inputs t, one 1 KB tile, element [i][c][p] = w[16 j + c][32 t + 2 i + p]
 * (i < 16 input pairs, c < 16 outputs, p < 2): the B operand of `tdpbf16ps` as it loads,
 * row-major over (j, t), so one output block's tiles are one contiguous stream. N is padded
 * to 32 (blocks go in pairs) and K to 32 with zeros.
 *
 * Activations are rounded to bf16 (as PyTorch's bf16 layers hold them) into rows of a
 * zero-padded scratch; the products accumulate in fp32. Compiled where the target has
 * AMX-BF16 (and AVX512-BF16, for the rounding): the tiles of dense_matmul_amx.h, where
 * `dense_tiles_available` also needs the kernel to have granted this process the tile state;
 * else where it has AVX512-BF16: the same packed tiles' rows as dot-product operands
 * (dense_matmul_dots.h).
 */
#ifndef FORKLIFT_DENSE_MATMUL_H
#define FORKLIFT_DENSE_MATMUL_H

#include "common.h"

#include <omp.h>

/* bf16 scratch elements dense_matmul_rows needs for `rows` rows of k inputs: whole tiles of
 * 16 rows and 32 columns (the dot products use the first `rows` of them). */
static inline int64_t dense_scratch_elements(int64_t rows, int64_t k) {
    return (rows + 15) / 16 * 16 * ((k + 31) / 32 * 32);
}

#if defined(FORKLIFT_DENSE_NATIVE)
/* Row r of xb [padded rows, k_padded]: x's row r [k] fp32 rounded to bf16, zeros past k;
 * all zeros for a padding row (r >= rows). */
static inline void dense_round_row(const float *x, int64_t r, int64_t rows, int64_t k,
                                   int64_t k_padded, uint16_t *xb) {
    uint16_t *row = xb + r * k_padded;
    const int64_t filled = r < rows ? k : 0;
    if (filled) round_to_bf16(x + r * k, k, row);
    memset(row + filled, 0, sizeof(uint16_t) * (size_t)(k_padded - filled));
}

/* Lanes of each of a pair's two 16-output blocks that exist (n need not be a multiple of
 * 32): the pair's first output is `col`. */
static inline void dense_pair_lanes(int64_t n, int64_t col, __mmask16 lanes[2]) {
    for (int c = 0; c < 2; c++) {
        const int64_t width = n - col - 16 * c;
        lanes[c] = width >= 16 ? 0xffff : width <= 0 ? 0 : (__mmask16)((1u << width) - 1);
    }
}

/* Every line of the tiles `ahead` tiles past tile t of a pair's two blocks, fetched with
 * __builtin_prefetch's `locality` (1-3; a constant at each call, as the builtin needs once
 * inlined). Near a block's end the addresses run on into the tiles after it (the second
 * block's, the next pair's, or past the buffer: a prefetch never faults, and the addresses
 * are formed as integers, not as pointers past the array). */
static inline __attribute__((always_inline)) void dense_prefetch_pair(
    const uint16_t *first, const uint16_t *second, int64_t t, int64_t ahead, int locality) {
    const uintptr_t offset = (uintptr_t)(t + ahead) * 1024;
    const uintptr_t a = (uintptr_t)first + offset, b = (uintptr_t)second + offset;
    for (uintptr_t line = 0; line < 1024; line += 64) {
        if (locality == 1) {
            __builtin_prefetch((const void *)(a + line), 0, 1);
            __builtin_prefetch((const void *)(b + line), 0, 1);
        } else if (locality == 2) {
            __builtin_prefetch((const void *)(a + line), 0, 2);
            __builtin_prefetch((const void *)(b + line), 0, 2);
        } else {
            __builtin_prefetch((const void *)(a + line), 0, 3);
            __builtin_prefetch((const void *)(b + line), 0, 3);
        }
    }
}

/* This thread's share [begin, end) of the pairs of output blocks: contiguous, in order. */
static inline void dense_thread_pairs(int64_t pairs, int64_t *begin, int64_t *end) {
    const int64_t threads = omp_get_num_threads(), id = omp_get_thread_num();
    const int64_t per = (pairs + threads - 1) / threads;
    *begin = id * per < pairs ? id * per : pairs;
    *end = *begin + per < pairs ? *begin + per : pairs;
}

#endif

/* The kernel (dense_matmul_rows, dense_tiles_available): AMX-BF16 tiles where this build has
 * them (isa/isa.h's FORKLIFT_DENSE_TILES), else AVX512-BF16 dot products
 * (FORKLIFT_DENSE_NATIVE); elsewhere no dense weight runs natively. */
#if defined(FORKLIFT_DENSE_TILES)
#include "dense_matmul_amx.h"
#elif defined(FORKLIFT_DENSE_NATIVE)
#include "dense_matmul_dots.h"
#else
static inline int dense_tiles_available(void) { return 0; }
#endif

#endif
