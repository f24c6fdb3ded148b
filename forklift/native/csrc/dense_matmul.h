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
