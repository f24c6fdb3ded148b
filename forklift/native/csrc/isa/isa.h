/* The one place that reads the compiler's target macros. It includes the vector header of
 * the widest instruction set this build targets (plain C, AVX2, AVX-512; AMX beside them)
 * and names what the build has, so the operations test these names, never __AVX*__:
 * - FORKLIFT_ISA_AVX512, FORKLIFT_ISA_AVX2 (set with it), or FORKLIFT_ISA_PLAIN;
 * - FORKLIFT_HAS_*: single features some kernels need beyond their level;
 * - LANES: floats in one register of the element-wise loops;
 * - the algorithm selectors the operations' drivers pick their kernels by
 *   (FORKLIFT_PAIRED_GROUPS, FORKLIFT_QUANT_TILES, FORKLIFT_DENSE_TILES,
 *   FORKLIFT_DENSE_NATIVE, ATTENTION_TILES, SCORE_FROM_BF16, ATTENTION_AMX) and the tuning
 *   that follows the instruction set (PREFETCH_BLOCKS, PREFETCH_LOCALITY).
 * Every choice keeps the condition the kernels were first written under, so a build takes
 * the same code, and gives the same bits, as before the layout. */
#ifndef FORKLIFT_ISA_H
#define FORKLIFT_ISA_H

#if defined(__AVX512F__)
#define FORKLIFT_ISA_AVX512 1
#endif
#if defined(__AVX2__)
#define FORKLIFT_ISA_AVX2 1
#endif
#if !defined(__AVX2__)
#define FORKLIFT_ISA_PLAIN 1
#endif

#if defined(__F16C__)
#define FORKLIFT_HAS_F16C 1
#endif
/* vpdpbusd on 256-bit registers (the eight-output group's int8 dot product). */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define FORKLIFT_HAS_VNNI_256 1
#endif
/* vpdpbusd on 512-bit registers with byte shifts (two groups at once). */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define FORKLIFT_HAS_AVX512_VNNI 1
#endif
#if defined(__AVX512BF16__)
#define FORKLIFT_HAS_AVX512_BF16 1
#endif
#if defined(__AMX_TILE__)
#define FORKLIFT_HAS_AMX 1
#endif
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define FORKLIFT_HAS_AMX_INT8 1
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define FORKLIFT_HAS_AMX_BF16 1
#endif

/* Element-wise work (exp, sigmoid, the cache's rows) runs on vectors of one register:
 * sixteen lanes with AVX-512, eight below it, where GCC lowers 16-lane arithmetic through
 * the stack (measured 5x slower on AVX2). */
#if defined(FORKLIFT_ISA_AVX512)
#define LANES 16
#else
#define LANES 8
#endif

#include "portable.h"

/* widen_fp8: sixteen fp8 codes to fp32 in one register (below AVX-512 the operations widen
 * code by code). */
#if defined(FORKLIFT_ISA_AVX512)
#define FORKLIFT_HAS_WIDEN_FP8 1
#endif

#if defined(FORKLIFT_ISA_AVX512)
#include "avx512.h"
#elif defined(FORKLIFT_ISA_AVX2)
#include "avx2.h"
#else
#include "plain.h"
#endif
#if defined(FORKLIFT_HAS_AMX)
#include "amx.h"
#endif

/* The quantized matmul's kernels (quant_matmul.h): two row groups at once in 512-bit
 * registers where VNNI has them, and from 16 rows AMX-INT8 tile products on top of those. */
#if defined(FORKLIFT_HAS_AVX512_VNNI)
#define FORKLIFT_PAIRED_GROUPS 1
#if defined(FORKLIFT_HAS_AMX_INT8)
#define FORKLIFT_QUANT_TILES 1
#endif
#endif

/* Software prefetch this many blocks ahead of the one being multiplied (quant_matmul.h): a
 * row group's blocks are one contiguous stream, and 32 blocks (4-8 KB) ahead read 30 layers'
 * projections 1.13-1.50x faster than none. The AVX-512 build, two streams at a time and
 * faster per block, ran 1.02-1.08x faster again at 64 blocks, where the AVX2 build ran
 * 0.96-0.99x as fast (benchmarks/scripts/prefetch_distance.py). A prefetch past the end of
 * the weights never faults. */
#ifndef PREFETCH_BLOCKS
#if defined(FORKLIFT_HAS_AVX512_VNNI)
#define PREFETCH_BLOCKS 64
#else
#define PREFETCH_BLOCKS 32
#endif
#endif

/* Which cache the weights' look-ahead prefetches fill (__builtin_prefetch's locality: 3 is
 * prefetcht0, into L1; 1 is prefetcht2, into L2). On AMD's Zen 4 (which GCC 12 tunes for as
 * znver3) the AVX-512 build's row pairs, two streams at a time, ran Gemma 3's 178 MB head
 * 1.61x and the default model's 1.71x faster at one row with L2 prefetches, its 30 layers
 * 1.28x (1.00-1.14x at 8-16 rows), where the AVX2 build's single streams ran 0.92-1.10x:
 * it keeps L1 (benchmarks/prefetch-locality.md). Intel cores keep L1, as measured when the
 * distances were chosen. Where the lines go never changes a bit. */
#ifndef PREFETCH_LOCALITY
#if defined(FORKLIFT_HAS_AVX512_VNNI) &&                                                   \
    (defined(__tune_znver4__) || defined(__tune_znver3__) || defined(__tune_znver5__))
#define PREFETCH_LOCALITY 1
#else
#define PREFETCH_LOCALITY 3
#endif
#endif

/* Dense bf16 matmuls (dense_matmul.h): on AMX-BF16 tiles (AVX512-BF16 rounds their inputs),
 * else on AVX512-BF16 dot products; FORKLIFT_DENSE_NATIVE where either runs. */
#if defined(FORKLIFT_HAS_AMX_BF16) && defined(FORKLIFT_HAS_AVX512_BF16)
#define FORKLIFT_DENSE_TILES 1
#endif
#if defined(FORKLIFT_DENSE_TILES) || \
    (defined(FORKLIFT_ISA_AVX512) && defined(FORKLIFT_HAS_AVX512_BF16))
#define FORKLIFT_DENSE_NATIVE 1
#endif

/* Decode attention in tiles of sixteen positions (paged_attention.h), their scores from
 * bf16 pairs where AVX512-BF16 multiplies them. */
#if defined(FORKLIFT_ISA_AVX512)
#define ATTENTION_TILES 1
#if defined(FORKLIFT_HAS_AVX512_BF16)
#define SCORE_FROM_BF16 1
#endif
/* ... and their dot products and value sums as AMX-BF16 tile products (the weights rounded
 * to bf16) where the tiles build, for a bf16 cache (paged_attention_amx.h). */
#if defined(FORKLIFT_HAS_AMX_BF16) && defined(FORKLIFT_HAS_AVX512_BF16)
#define ATTENTION_AMX 1
#endif
#endif

#endif
