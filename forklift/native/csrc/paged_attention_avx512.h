/* Decode attention in tiles of sixteen positions, on AVX-512 (ATTENTION_TILES), for a bf16
 * or coded cache and head sizes of 64, 128 or 256: the form the decode step and the
 * per-layer kernel run where it builds (paged_attention.h's attend_rows is the fallback
 * everywhere else, and the header that includes this one).
 *
 * A task is one KV head of a run of rows reading the same blocks (a decode row, or the rows
 * verifying a sequence's drafts), over one range of positions. Tiles are aligned to sixteen
 * positions, so a position's lane never depends on which rows share the task:
 * - each tile's mask says which of its positions any row attends to (each row's masks a
 *   vector compare of its bias row, once per call: RowMasks); tiles outside the first and
 *   last live ones are never touched;
 * - the key rows of a tile serve every query vector (read as bf16 pairs by vdpbf16ps with
 *   AVX512_BF16, else widened to fp32 once), the sixteen dot products of a vector summed
 *   together (sum16) and stored whole; where AMX-BF16 tiles build and the kernel grants
 *   them, a bf16 cache's scores and value sums are tile products instead
 *   (paged_attention_amx.h);
 * - positions no row attends to inside a live tile load a live row instead: their weight is
 *   exactly 0, so every position of a tile is summed without a branch, with the same result
 *   as skipping it.
 *
 * Ranges (flash-decoding's split) cut a long context into chunks of ATTENTION_CHUNK
 * positions that run as tasks of their own, each leaving its maximum, its sum of weights
 * and its unnormalised output per query vector; merge_chunks combines them in chunk order.
 * The chunks are fixed by position, not by the batch, so a row's result is the same whatever
 * rows share its step.
 */
#ifndef FORKLIFT_PAGED_ATTENTION_AVX512_H
#define FORKLIFT_PAGED_ATTENTION_AVX512_H

#include "paged_attention.h"

/* Positions per chunk, a task's share of a long context (256 KB of K and V per KV head at a
 * head size of 64). Chunks of 256 measured slower at 564 positions: their partial results
 * and merges cost more than the balance between threads gained. */
#define ATTENTION_CHUNK 1024

/* Rows of the tile this many tiles ahead are prefetched while a tile is computed (one to
 * eight measured alike: the passes are bound by the rows' reads either way). */
#define TILE_AHEAD 2

/* One vector's partial result over a chunk: [max, sum, acc[head_dim]]. */
#define PART_FLOATS(head_dim) ((head_dim) + 2)

typedef float float16_unaligned __attribute__((vector_size(64), aligned(4)));

/* Sixteen bf16 values widened to fp32 in one zero-extension and one shift (the generic
 * widen_bf16 compiles to two halves and their joins where GCC prefers 256-bit vectors). */
static inline float16_vector widen16(const uint16_t *src) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)src));
    return (float16_vector)_mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

/* The lane sums of sixteen vectors as the sixteen lanes of one (isa/avx512.h). */
static inline float16_vector sum16(const float16_vector a[16]) { return combine16(a, 0); }

/* The positions of tile t0 .. t0 + 15 a bias row attends to (bit p: position t0 + p). */
static inline unsigned tile_mask(const float *bias_row, int64_t t0, int64_t to) {
    if (t0 + 16 <= to)
        return _mm512_cmp_ps_mask(_mm512_loadu_ps(bias_row + t0), _mm512_set1_ps(-INFINITY),
                                  _CMP_NEQ_UQ);
    unsigned mask = 0;
    for (int64_t p = 0; t0 + p < to; p++) mask |= (unsigned)(bias_row[t0 + p] != -INFINITY) << p;
    return mask;
}

/* A bias row's values at tile t0 .. t0 + 15, -inf at positions at or past `end`. */
static inline float16_vector tile_bias(const float *bias_row, int64_t t0, int64_t end) {
    if (t0 + 16 <= end) return *(const float16_unaligned *)(bias_row + t0);
    float16_vector bias;
    for (int p = 0; p < 16; p++) bias[p] = t0 + p < end ? bias_row[t0 + p] : -INFINITY;
    return bias;
}

/* Every row's tile masks (tile_mask of each sixteen positions of its bias row, positions
 * past the row's width masked), computed once per call: a prefill chunk's tasks and their
 * blocks of query vectors each asked them of the bias rows again, a third of a 730-token
 * prompt's attention spent loading them. `pure`: every bias is 0 or -inf, so a mask says
 * all a bias would (the tile kernels then read no bias row). Row r's masks start at
 * masks + r * stride. */
typedef struct {
    uint16_t *masks;
    int64_t stride;
    int pure;
} RowMasks;

/* Row r's masks of a bias row of `width` positions into all.masks (see RowMasks); returns
 * whether every bias of the row is 0 or -inf. */
static inline int row_masks_fill(const float *bias, int64_t r, int64_t width, RowMasks all) {
    const float *row = bias + r * width;
    int pure = 1;
    for (int64_t i = 0; i < all.stride; i++) {
        const float16_vector b = tile_bias(row, 16 * i, width);
        const __mmask16 attended =
            _mm512_cmp_ps_mask((__m512)b, _mm512_set1_ps(-INFINITY), _CMP_NEQ_UQ);
        const __mmask16 zero = _mm512_cmp_ps_mask((__m512)b, _mm512_setzero_ps(), _CMP_EQ_OQ);
        pure &= (attended & ~zero) == 0;
        all.masks[r * all.stride + i] = (uint16_t)attended;
    }
    return pure;
}

/* One query vector's scores at a tile from its sixteen dot products' lanes (acc[p] for
 * position t0 + p): each position's row scale (row_scales: a coded tile's; NULL: none),
 * scale and the vector's bias applied (positions at or past `end` get -inf), stored whole
 * at `dst`, the maxima kept lane by lane. */
static inline __attribute__((always_inline)) void finish_scores(
    const float16_vector acc[16], const float *bias_row, int64_t t0, int64_t end, float scale,
    float *dst, float16_vector *max_lanes, const float16_vector *row_scales) {
    const float16_vector bias = tile_bias(bias_row, t0, end);
    const float16_vector dots = row_scales != NULL ? sum16(acc) * *row_scales : sum16(acc);
    const float16_vector s = dots * scale + bias;
    *(float16_unaligned *)dst = s;
    const int16_vector higher = s > *max_lanes;
    *max_lanes = (float16_vector)(((int16_vector)s & higher) | ((int16_vector)*max_lanes & ~higher));
}

#if defined(SCORE_FROM_BF16)
/* Every query vector's scores at one tile (positions t0 .. t0 + 15) straight from the bf16
 * key rows: vdpbf16ps multiplies two dimensions a lane against the query rounded to bf16
 * (as PyTorch's bf16 layers hold it; the native step's fp32 queries take that rounding
 * here), so no key row is widened. A coded tile's rows come as their codes in bf16 (exact)
 * with `row_scales` applied to the dot products (NULL for a bf16 cache). */
static inline __attribute__((always_inline)) void score_tile(
    const uint16_t *queries, int64_t count, const uint16_t *const *rows,
    const float *const *query_bias, int64_t t0, int64_t end, float scale, int64_t head_dim,
    float *scores, int64_t stride, int64_t column, float16_vector *max_lanes,
    const float16_vector *row_scales) {
    const int64_t pairs = head_dim / 32;
    for (int64_t j = 0; j < count; j++) {
        __m512bh q[8];
        for (int64_t c = 0; c < pairs; c++)
            q[c] = (__m512bh)_mm512_loadu_si512(queries + j * head_dim + 32 * c);
        float16_vector acc[16];
#pragma GCC unroll 16
        for (int p = 0; p < 16; p++) {
            __m512 a = _mm512_setzero_ps();
            for (int64_t c = 0; c < pairs; c++)
                a = _mm512_dpbf16_ps(a, q[c], (__m512bh)_mm512_loadu_si512(rows[p] + 32 * c));
            acc[p] = (float16_vector)a;
        }
        finish_scores(acc, query_bias[j], t0, end, scale, scores + j * stride + column,
                      &max_lanes[j], row_scales);
    }
}

/* A coded tile's sixteen rows of codes as bf16 (exact: an int8 code, an fp8 value) into
 * `codes` [16, head_dim] and their scales into `row_scales`, for score_tile. */
static inline __attribute__((always_inline)) void coded_tile_as_bf16(
    const char *const *rows, int64_t head_dim, uint16_t *codes, float16_vector *row_scales,
    int format) {
    for (int p = 0; p < 16; p++) {
        const char *row = rows[p];
        (*row_scales)[p] = coded_row_scale(format, row, head_dim);
        for (int64_t c = 0; c < head_dim; c += 32) {
            const __m512 low = (__m512)widen_codes(row + c, format);
            const __m512 high = (__m512)widen_codes(row + c + 16, format);
            _mm512_storeu_si512(codes + p * head_dim + c, (__m512i)_mm512_cvtne2ps_pbh(high, low));
        }
    }
}
#endif

/* Every query vector's scores at one tile (positions t0 .. t0 + 15) from its key rows
 * widened to fp32 once into `keys` [16, head_dim] for all vectors: bf16 rows as they are,
 * coded rows' codes times their row's scale. */
static inline __attribute__((always_inline)) void score_tile_widened(
    const float *queries, int64_t count, const char *const *rows, float *keys,
    const float *const *query_bias, int64_t t0, int64_t end, float scale, int64_t head_dim,
    float *scores, int64_t stride, int64_t column, float16_vector *max_lanes, int format) {
    const int64_t chunks = head_dim / 16;
    for (int p = 0; p < 16; p++) {
        float16_unaligned *key = (float16_unaligned *)(keys + p * head_dim);
        if (cache_coded(format)) {
            const float row_scale = coded_row_scale(format, rows[p], head_dim);
            for (int64_t c = 0; c < chunks; c++)
                key[c] = widen_codes(rows[p] + 16 * c, format) * row_scale;
        } else {
            for (int64_t c = 0; c < chunks; c++)
                key[c] = widen16((const uint16_t *)rows[p] + 16 * c);
        }
    }
    for (int64_t j = 0; j < count; j++) {
        const float16_unaligned *q = (const float16_unaligned *)(queries + j * head_dim);
        float16_vector acc[16];
#pragma GCC unroll 16
        for (int p = 0; p < 16; p++) {
            const float16_unaligned *k = (const float16_unaligned *)(keys + p * head_dim);
            acc[p] = q[0] * k[0];
            for (int64_t c = 1; c < chunks; c++) acc[p] += q[c] * k[c];
        }
        finish_scores(acc, query_bias[j], t0, end, scale, scores + j * stride + column,
                      &max_lanes[j], NULL);
    }
}

/* acc[first + h] = sum over the live tiles' positions of weight * V, for `pass` vectors,
 * the sums in registers (pass, head_dim and format constants once inlined; a coded row's
 * scale joins its weight). */
static inline __attribute__((always_inline)) void tile_values(
    float *acc, const float *scores, int64_t stride, const char *v_head, const int64_t *slots,
    const uint16_t *masks, int64_t tiles, int64_t first, int64_t head_dim, int64_t pass,
    int format) {
    const int64_t chunks = head_dim / 16;
    const size_t row_bytes = cache_row_bytes(format, head_dim);
    float16_vector sums[4][16] = {{{0}}};
    for (int64_t i = 0; i < tiles; i++) {
        if (masks[i] == 0) continue;
        const int ahead = i + TILE_AHEAD < tiles && masks[i + TILE_AHEAD] != 0;
        for (int p = 0; p < 16; p++) {
            if (ahead) prefetch_row(v_head, slots[16 * (i + TILE_AHEAD) + p], row_bytes);
            const char *row = v_head + (size_t)slots[16 * i + p] * row_bytes;
            float16_vector v[16];
            float row_scale = 1.0f;
            if (cache_coded(format)) {
                row_scale = coded_row_scale(format, row, head_dim);
                for (int64_t c = 0; c < chunks; c++) v[c] = widen_codes(row + 16 * c, format);
            } else {
                for (int64_t c = 0; c < chunks; c++) v[c] = widen16((const uint16_t *)row + 16 * c);
            }
            for (int64_t h = 0; h < pass; h++) {
                const float w = scores[(first + h) * stride + 16 * i + p] * row_scale;
                for (int64_t c = 0; c < chunks; c++) sums[h][c] += w * v[c];
            }
        }
    }
    for (int64_t h = 0; h < pass; h++)
        memcpy(acc + (first + h) * head_dim, sums[h], sizeof(float) * (size_t)head_dim);
}

#if defined(ATTENTION_AMX)
#include "paged_attention_amx.h"
#endif

/* Whether a cache of `format` attends on AMX tiles here (paged_attention_amx.h). */
static inline int attention_on_tiles(int format) {
#if defined(ATTENTION_AMX)
    return format == CACHE_BF16 && amx_tiles_usable();
#else
    (void)format;
    return 0;
#endif
}

/* One thread's scratch for all its tasks, sized for the largest: attend_range's vectors
 * (`range`, its layout there) and attend_amx's (`tiles`, on tiles only). Allocated once
 * per thread and call: a step's decode rows are a task each, and two allocations a task
 * cost a tenth of an RL rollout's attention. Both parts in one block; free `range`. */
typedef struct {
    float *range;
    uint16_t *tiles;
} TaskScratch;

/* Up to `count` query vectors over up to `span` positions (a multiple of 16); range NULL
 * when out of memory. */
static inline TaskScratch task_scratch_alloc(int64_t count, int64_t span, int64_t head_dim,
                                             int on_tiles) {
    const int64_t score_floats = on_tiles ? 0 : count * span;
    const size_t floats = (size_t)(score_floats + 2 * count * head_dim + 16 * head_dim +
                                   count * head_dim / 2);
    const size_t range = (sizeof(float) * floats + sizeof(int64_t) * (size_t)(span + 1) + 63)
                         / 64 * 64;
#if defined(ATTENTION_AMX)
    const size_t tiles = on_tiles ? amx_scratch_bytes(span, head_dim) : 0;
#else
    const size_t tiles = 0;
#endif
    char *block = aligned_alloc(64, range + tiles); /* both multiples of 64 */
    return (TaskScratch){(float *)block, block != NULL && tiles ? (uint16_t *)(block + range)
                                                                : NULL};
}

/* attend_range's scores, weights and value sums on vectors (scores: [count, span] scratch;
 * keys: [16, head_dim] scratch). Leaves each vector's unnormalised sums in acc, its largest
 * score and its total weight. */
static inline __attribute__((always_inline)) void attend_vectors(
    const float *queries, const uint16_t *queries_bf16, int64_t count,
    const float *const *query_bias, const char *k_head, const char *v_head,
    const int64_t *slots, const uint16_t *masks, int64_t live_tiles, int64_t base, int64_t to,
    float scale, int64_t head_dim, int format, float *scores, float *keys, float *acc,
    float *max_score, float *total) {
    const int64_t span = 16 * live_tiles;
    const size_t row_bytes = cache_row_bytes(format, head_dim);
    (void)queries_bf16;
    float16_vector max_lanes[count];
    for (int64_t j = 0; j < count; j++) max_lanes[j] = (float16_vector){0} - INFINITY;
    for (int64_t i = 0; i < live_tiles; i++) {
        if (masks[i] == 0) {
            for (int64_t j = 0; j < count; j++)
                for (int p = 0; p < 16; p++) scores[j * span + 16 * i + p] = -INFINITY;
            continue;
        }
        const int ahead = i + TILE_AHEAD < live_tiles && masks[i + TILE_AHEAD] != 0;
        const char *rows[16];
        for (int p = 0; p < 16; p++) {
            if (ahead) {
                const int64_t slot = slots[16 * (i + TILE_AHEAD) + p];
                prefetch_row(k_head, slot, row_bytes);
                /* The same tile's value rows into L2 for the value pass: two streams in
                 * flight while the scores are computed, not one (5-10% faster cold). */
                prefetch_row_l2(v_head, slot, row_bytes);
            }
            rows[p] = k_head + (size_t)slots[16 * i + p] * row_bytes;
        }
#if defined(SCORE_FROM_BF16)
        if (format == CACHE_BF16) {
            score_tile(queries_bf16, count, (const uint16_t *const *)rows, query_bias,
                       base + 16 * i, to, scale, head_dim, scores, span, 16 * i, max_lanes,
                       NULL);
            continue;
        }
        /* Coded: the tile's codes as bf16 in `keys`' room (half of it), scales per row. */
        float16_vector row_scales;
        uint16_t *codes = (uint16_t *)keys;
        coded_tile_as_bf16(rows, head_dim, codes, &row_scales, format);
        const uint16_t *code_rows[16];
        for (int p = 0; p < 16; p++) code_rows[p] = codes + p * head_dim;
        score_tile(queries_bf16, count, code_rows, query_bias, base + 16 * i, to, scale,
                   head_dim, scores, span, 16 * i, max_lanes, &row_scales);
        continue;
#endif
        score_tile_widened(queries, count, rows, keys, query_bias, base + 16 * i, to, scale,
                           head_dim, scores, span, 16 * i, max_lanes, format);
    }

    /* Weights exp(s - max) in place, summed in sixteen lanes by position mod 16. A vector
     * none of whose positions lie in the range weighs nothing here. */
    for (int64_t j = 0; j < count; j++) {
        float m = -INFINITY;
        for (int p = 0; p < 16; p++) m = max_lanes[j][p] > m ? max_lanes[j][p] : m;
        max_score[j] = m;
        float *sj = scores + j * span;
        float16_vector sums = {0};
        for (int64_t t = 0; t < span; t += 16) {
            /* (LANES is 16 here: lane_vector is a float16_vector) */
            const float16_vector w = m == -INFINITY
                                         ? (float16_vector){0}
                                         : exp_nonpositive_lanes(*(float16_unaligned *)(sj + t) - m);
            *(float16_unaligned *)(sj + t) = w;
            sums += w;
        }
        float sum = 0.0f;
        for (int l = 0; l < 16; l++) sum += sums[l];
        total[j] = sum;
    }

    /* Passes of as many vectors as fit the registers (16 accumulators), a constant each. */
    const int64_t per_pass = head_dim >= 256 ? 1 : 256 / head_dim;
    for (int64_t j = 0; j < count; j += per_pass) {
        const int64_t left = count - j < per_pass ? count - j : per_pass;
        if (left == 1)
            tile_values(acc, scores, span, v_head, slots, masks, live_tiles, j, head_dim, 1,
                        format);
        else if (left == 2)
            tile_values(acc, scores, span, v_head, slots, masks, live_tiles, j, head_dim, 2,
                        format);
        else if (left == 3)
            tile_values(acc, scores, span, v_head, slots, masks, live_tiles, j, head_dim, 3,
                        format);
        else
            tile_values(acc, scores, span, v_head, slots, masks, live_tiles, j, head_dim, 4,
                        format);
    }

}

/* Attention of rows first_row .. first_row + num_rows - 1 (same blocks) for one KV head over
 * positions [from, to) (from a multiple of 16). parts == NULL: the normalised output into
 * `out` ([rows, heads, D], fp32 or bf16 by io_bf16); else each query vector's partial
 * result for chunk `chunk` into parts, [rows, heads, num_chunks, PART_FLOATS]. q: [rows,
 * heads, D], fp32 or bf16 by io_bf16. `scratch`: the thread's (task_scratch_alloc). */
static inline __attribute__((always_inline)) void attend_range(
    const void *q, const void *key_cache, const void *value_cache, const int64_t *blocks,
    const float *bias, void *out, int64_t first_row, int64_t num_rows, int64_t kv_head,
    int64_t heads, int64_t kv_heads, int64_t num_blocks, int64_t block_size, int64_t head_dim,
    int64_t table_width, float scale, int io_bf16, int64_t from, int64_t to, float *parts,
    int64_t chunk, int64_t num_chunks, int format, RowMasks row_masks, TaskScratch scratch) {
    const int64_t group = heads / kv_heads, count = num_rows * group;
    const int64_t width = table_width * block_size;
    if (to > width) to = width;
    const int64_t tiles = to > from ? (to - from + 15) / 16 : 0;
    const size_t io_elem = io_bf16 ? 2 : 4, row_bytes = cache_row_bytes(format, head_dim);
    const int64_t *table = blocks + first_row * table_width;
    const float *query_bias[count];
    /* Each query vector's row and head, laid out once (a division per vector cost more than
     * the vector's normalisation). */
    int64_t vector_row[count], vector_head[count];
    for (int64_t r = 0, j = 0; r < num_rows; r++)
        for (int64_t h = 0; h < group; h++, j++) {
            vector_row[j] = first_row + r;
            vector_head[j] = kv_head * group + h;
        }
    for (int64_t j = 0; j < count; j++) query_bias[j] = bias + vector_row[j] * width;

    /* Which positions of each tile any row attends to; the live span of tiles. */
    uint16_t all_masks[tiles + 1];
    int64_t lo = -1, hi = -1;
    const uint16_t *first_masks = row_masks.masks + first_row * row_masks.stride + from / 16;
    for (int64_t i = 0; i < tiles; i++) {
        unsigned mask = 0;
        for (int64_t r = 0; r < num_rows; r++) mask |= first_masks[r * row_masks.stride + i];
        all_masks[i] = (uint16_t)mask;
        if (mask != 0) {
            if (lo < 0) lo = i;
            hi = i;
        }
    }
    const int64_t live_tiles = lo < 0 ? 0 : hi - lo + 1, span = 16 * live_tiles;
    const int64_t base = from + 16 * (lo < 0 ? 0 : lo);
    const uint16_t *masks = all_masks + (lo < 0 ? 0 : lo);

    const int on_tiles = attention_on_tiles(format);
    /* The vector form's scores (the tiles keep a block's at a time in their own scratch). */
    const int64_t score_floats = on_tiles ? 0 : count * span;
    float *scores = scratch.range;               /* [count, span] */
    float *queries = scores + score_floats;      /* [count, D] */
    float *acc = queries + count * head_dim;  /* [count, D] */
    float *keys = acc + count * head_dim;     /* [16, D] */
    uint16_t *queries_bf16 = (uint16_t *)(keys + 16 * head_dim); /* [count, D] */
    int64_t *slots = (int64_t *)(queries_bf16 + count * head_dim); /* [span] */

    /* Each position's cache slot, block by block (no division per position); in a live
     * tile, a position no row attends to takes the tile's first live position's slot. */
    int64_t block = base / block_size, offset = base % block_size;
    for (int64_t p = 0; p < span; p++) {
        slots[p] = base + p < width ? table[block] * block_size + offset : 0;
        if (++offset == block_size) {
            offset = 0;
            block++;
        }
    }
    for (int64_t i = 0; i < live_tiles; i++) {
        const unsigned mask = masks[i];
        if (mask == 0 || mask == 0xffffu) continue;
        const int64_t fill = slots[16 * i + __builtin_ctz(mask)];
        for (int p = 0; p < 16; p++)
            if (!(mask >> p & 1u)) slots[16 * i + p] = fill;
    }

    const size_t head_bytes = (size_t)(num_blocks * block_size) * row_bytes;
    const char *k_head = (const char *)key_cache + (size_t)kv_head * head_bytes;
    const char *v_head = (const char *)value_cache + (size_t)kv_head * head_bytes;
    for (int64_t j = 0; j < count; j++) {
        const int64_t row = vector_row[j], head = vector_head[j];
        LOAD_ROW(queries + j * head_dim, (const char *)q + (size_t)((row * heads + head) *
                 head_dim) * io_elem, head_dim, io_bf16);
    }
#if defined(SCORE_FROM_BF16)
    round_to_bf16(queries, count * head_dim, queries_bf16);
#endif

    float max_score[count], total[count];
#if defined(ATTENTION_AMX)
    if (on_tiles) {
        /* Each vector's masks from the first live tile on. */
        const uint16_t *query_masks[count];
        for (int64_t j = 0; j < count; j++)
            query_masks[j] = row_masks.masks + vector_row[j] * row_masks.stride + base / 16;
        attend_amx(queries_bf16, count, query_bias, query_masks, row_masks.pure, k_head,
                   v_head, slots, masks, live_tiles, base, to, scale, head_dim, acc, max_score,
                   total, scratch.tiles);
    } else
#endif
        attend_vectors(queries, queries_bf16, count, query_bias, k_head, v_head, slots, masks,
                       live_tiles, base, to, scale, head_dim, format, scores, keys, acc,
                       max_score, total);

    for (int64_t j = 0; j < count; j++) {
        const float *aj = acc + j * head_dim;
        const int64_t row = vector_row[j], head = vector_head[j];
        if (parts != NULL) {
            float *pj = parts + ((row * heads + head) * num_chunks + chunk) * PART_FLOATS(head_dim);
            pj[0] = max_score[j];
            pj[1] = total[j];
            memcpy(pj + 2, aj, sizeof(float) * (size_t)head_dim);
            continue;
        }
        char *out_row = (char *)out + (size_t)((row * heads + head) * head_dim) * io_elem;
        store_normalised(out_row, aj, total[j], head_dim, io_bf16);
    }
}

/* One query vector's output from its chunks' partial results (parts[c * part_stride], in
 * chunk order): weights rescaled to the largest maximum, then normalised; a chunk with no
 * live position adds exactly nothing, so a row's result does not depend on how far other
 * rows' tables reach. out: head_dim values, fp32 or bf16 by io_bf16. */
static inline void merge_chunks(const float *parts, int64_t chunks, int64_t part_stride,
                                int64_t head_dim, void *out, int io_bf16) {
    float m = -INFINITY;
    for (int64_t c = 0; c < chunks; c++) {
        const float mc = parts[c * part_stride];
        m = mc > m ? mc : m;
    }
    float merged[head_dim], total = 0.0f;
    for (int64_t d = 0; d < head_dim; d++) merged[d] = 0.0f;
    for (int64_t c = 0; c < chunks && m != -INFINITY; c++) {
        const float *pc = parts + c * part_stride;
        if (pc[0] == -INFINITY) continue;
        const float factor = exp_nonpositive(pc[0] - m);
        total += pc[1] * factor;
        for (int64_t d = 0; d < head_dim; d++) merged[d] += pc[2 + d] * factor;
    }
    store_normalised(out, merged, total, head_dim, io_bf16);
}

/* attend_range with the head size (64, 128 or 256) and the cache format constants. */
static inline void attend_chunk(const void *q, const void *key_cache, const void *value_cache,
                                const int64_t *blocks, const float *bias, void *out,
                                int64_t first_row, int64_t num_rows, int64_t kv_head,
                                int64_t heads, int64_t kv_heads, int64_t num_blocks,
                                int64_t block_size, int64_t head_dim, int64_t table_width,
                                float scale, int io_bf16, int64_t chunk, int64_t num_chunks,
                                float *parts, int format, RowMasks row_masks,
                                TaskScratch scratch) {
    const int64_t from = chunk * ATTENTION_CHUNK, to = from + ATTENTION_CHUNK;
#define ATTEND_CHUNK(size, form)                                                              \
    attend_range(q, key_cache, value_cache, blocks, bias, out, first_row, num_rows, kv_head,  \
                 heads, kv_heads, num_blocks, block_size, size, table_width, scale, io_bf16,  \
                 from, to, parts, chunk, num_chunks, form, row_masks, scratch)
#define ATTEND_SIZES(form)                                                                    \
    do {                                                                                      \
        if (head_dim == 64) ATTEND_CHUNK(64, form);                                           \
        else if (head_dim == 128) ATTEND_CHUNK(128, form);                                    \
        else ATTEND_CHUNK(256, form);                                                         \
        return;                                                                               \
    } while (0)
    if (format == CACHE_INT8) ATTEND_SIZES(CACHE_INT8);
    if (format == CACHE_FP8_E4M3) ATTEND_SIZES(CACHE_FP8_E4M3);
    if (format == CACHE_FP8_E5M2) ATTEND_SIZES(CACHE_FP8_E5M2);
    ATTEND_SIZES(CACHE_BF16);
#undef ATTEND_SIZES
#undef ATTEND_CHUNK
}

/* Caches and head sizes the tiles serve (fp32 caches take attend_rows). */
static inline int tiles_cover(int64_t head_dim, int format) {
    return format != CACHE_FP32 && (head_dim == 64 || head_dim == 128 || head_dim == 256);
}

/* Every task of a step's attention: each piece of rows (first[i], length[i]: rows reading
 * the same blocks), KV head and chunk of ATTENTION_CHUNK positions. Where the tables reach
 * past one chunk, each chunk leaves partial results, merged per query vector once all
 * tasks are done. The chunks depend on positions only, so a row's result is the same in
 * any batch. q and out: [rows, heads, head_dim], fp32 or bf16 by io_bf16; format: the
 * cache's CACHE_BF16 or a coded CACHE_*. Returns 1 when scratch memory ran out. */
static int tiled_attention(const void *q, const void *key_cache, const void *value_cache,
                           const int64_t *blocks, const float *bias, void *out, int64_t rows,
                           int64_t heads, int64_t kv_heads, int64_t num_blocks,
                           int64_t block_size, int64_t head_dim, int64_t table_width,
                           float scale, int io_bf16, const int64_t *first,
                           const int64_t *length, int64_t pieces, int num_threads,
                           int format) {
    const int64_t width = table_width * block_size;
    /* At least one chunk: a table of no width still writes its (zero) outputs. */
    const int64_t chunks_spanned = (width + ATTENTION_CHUNK - 1) / ATTENTION_CHUNK;
    const int64_t num_chunks = chunks_spanned > 1 ? chunks_spanned : 1;
    const int64_t part_stride = PART_FLOATS(head_dim), vectors = rows * heads;
    float *parts = NULL;
    if (num_chunks > 1) {
        parts = malloc(sizeof(float) * (size_t)(vectors * num_chunks * part_stride));
        if (parts == NULL) return 1;
    }
    const int64_t mask_stride = (width + 15) / 16;
    RowMasks row_masks = {malloc(sizeof(uint16_t) * (size_t)(rows * mask_stride + 1)),
                          mask_stride, 1};
    if (row_masks.masks == NULL) {
        free(parts);
        return 1;
    }
    int impure = 0;
    const int64_t tasks = pieces * kv_heads * num_chunks;
    const size_t io_elem = io_bf16 ? 2 : 4;
    /* The largest task: the longest piece's vectors over a chunk's positions. */
    int64_t max_rows = 0;
    for (int64_t i = 0; i < pieces; i++) max_rows = length[i] > max_rows ? length[i] : max_rows;
    const int64_t max_count = max_rows * (heads / kv_heads);
    const int64_t max_span = (width < ATTENTION_CHUNK ? width + 15 : ATTENTION_CHUNK) / 16 * 16;
    const int on_tiles = attention_on_tiles(format);
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++)
            if (!row_masks_fill(bias, r, width, row_masks)) {
#pragma omp atomic write
                impure = 1;
            }
        /* (the loop's barrier: every row's masks and `impure` are in) */
        RowMasks masks = row_masks;
        masks.pure = !impure;
        /* Scratch and the tiles' configuration once per thread, for all its tasks. */
        TaskScratch scratch = task_scratch_alloc(max_count, max_span, head_dim, on_tiles);
        if (scratch.range == NULL) failed = 1;
#if defined(ATTENTION_AMX)
        if (on_tiles) attention_tiles_configure();
#endif
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            if (scratch.range == NULL) continue;
            const int64_t chunk = task % num_chunks, rest = task / num_chunks;
            const int64_t piece = rest / kv_heads, kv_head = rest % kv_heads;
            attend_chunk(q, key_cache, value_cache, blocks, bias, out, first[piece],
                         length[piece], kv_head, heads, kv_heads, num_blocks, block_size,
                         head_dim, table_width, scale, io_bf16, chunk, num_chunks, parts,
                         format, masks, scratch);
        }
#if defined(ATTENTION_AMX)
        if (on_tiles) amx_tiles_release();
#endif
        free(scratch.range);
        if (parts != NULL) {
#pragma omp for schedule(static)
            for (int64_t v = 0; v < vectors; v++)
                merge_chunks(parts + v * num_chunks * part_stride, num_chunks, part_stride,
                             head_dim, (char *)out + (size_t)(v * head_dim) * io_elem, io_bf16);
        }
    }
    free(parts);
    free(row_masks.masks);
    return failed;
}

#endif
