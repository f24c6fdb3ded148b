/* Attention on AMX-BF16 tiles (ATTENTION_AMX) for a bf16 cache: one task of
 * paged_attention_avx512.h's attend_range (a run of rows reading the same blocks, one KV
 * head, one chunk of positions) with its dot products and value sums as tile products.
 *
 * The task's query vectors go in blocks of sixteen. For each block and each tile of sixteen
 * positions any of its rows attends to:
 * - scores, 32 dimensions a product: with three blocks or more (a prefill chunk's rows), the
 *   block's queries (an A tile) against the tile's keys packed once per task as dimension
 *   pairs (a B tile), each query's row of scores straight from the product; with one or two
 *   (decode rows), the sixteen key rows (an A tile, straight from the cache where their
 *   slots are consecutive) against the block's queries as bf16 pairs (a B tile, the block
 *   transposed once), the 16 x 16 result transposed to a row per query (up to four vectors
 *   gather their columns). Each score is the same products summed in the same order either
 *   way;
 * - the scale, and the bias through each row's tile masks where it is all 0 and -inf;
 * - each query's weights exp(s - max) rounded to bf16 (the weights the products multiply,
 *   and the ones the total sums), then the values: weights (an A tile of sixteen positions)
 *   against the tile's value rows interleaved in position pairs (B tiles, packed once per
 *   task), sixteen output values a tile, four tiles of sums at a time.
 *
 * A tile product's every output depends on its own A row and B column only, positions are
 * tiled from fixed multiples of sixteen, and a tile a query does not attend to adds exact
 * zeros (weights 0 against finite rows): a row's result is the same bits whatever rows share
 * its block, its task or its step, and whether it is a prompt's row or a decode row. (A sum
 * the tiles flushed to -0 could turn +0 by such a zero tile: the sums are copied out plus
 * +0, so a zero is always +0.)
 */
#ifndef FORKLIFT_PAGED_ATTENTION_AMX_H
#define FORKLIFT_PAGED_ATTENTION_AMX_H

/* Tiles 0-3: a block's value sums, sixteen output values each (tile 0 holds a tile's
 * scores before them); 4 and 5, 32 dimensions: the block's queries and sixteen keys as
 * dimension pairs, or sixteen key rows and the block's queries as pairs; 6: the block's
 * weights at sixteen positions; 7: those positions' value rows as pairs, sixteen output
 * values. */
static inline void attention_tiles_configure(void) {
    AmxTileConfig config = {.palette = 1};
    for (int t = 0; t < 8; t++) {
        config.colsb[t] = 64;
        config.rows[t] = 16;
    }
    config.colsb[6] = 32; /* sixteen positions of bf16 weights */
    config.rows[7] = 8;   /* their eight pairs of value rows */
    _tile_loadconfig(&config);
}

/* Bytes of attend_amx's scratch for a task of up to `span` positions. */
static inline size_t amx_scratch_bytes(int64_t span, int64_t head_dim) {
    const size_t elements = (size_t)(2 * span * head_dim + 16 * head_dim + 2 * 16 * span +
                                     16 * span + 2 * 16 * head_dim + 16 * head_dim + 2 * 256);
    return (elements * 2 + 63) / 64 * 64;
}

/* dst row j = src column j for 16 x 16 four-byte elements (rows `src_stride` and
 * `dst_stride` bytes apart): pairs of rows interleaved by element, then by element pair,
 * then the 4 x 4 grid of 128-bit lanes transposed. */
static inline void transpose16(const char *src, size_t src_stride, char *dst, size_t dst_stride) {
    __m512i r[16], t[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512(src + i * src_stride);
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    /* r[4g + c], lane L: column 4L + c, rows 4g .. 4g + 3 */
    for (int g = 0; g < 16; g += 4) {
        r[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
        r[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
        r[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
        r[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
    }
    for (int c = 0; c < 4; c++) {
        const __m512i low_ab = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x44);
        const __m512i high_ab = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xee);
        const __m512i low_cd = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x44);
        const __m512i high_cd = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xee);
        _mm512_storeu_si512(dst + c * dst_stride, _mm512_shuffle_i32x4(low_ab, low_cd, 0x88));
        _mm512_storeu_si512(dst + (4 + c) * dst_stride, _mm512_shuffle_i32x4(low_ab, low_cd, 0xdd));
        _mm512_storeu_si512(dst + (8 + c) * dst_stride, _mm512_shuffle_i32x4(high_ab, high_cd, 0x88));
        _mm512_storeu_si512(dst + (12 + c) * dst_stride, _mm512_shuffle_i32x4(high_ab, high_cd, 0xdd));
    }
}

/* Two value rows (positions 2k, 2k + 1) as one row of pairs: value d of both side by side. */
static inline void interleave_rows(const uint16_t *even, const uint16_t *odd, int64_t head_dim,
                                   uint16_t *dst) {
    const __m512i low = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9,
                                         40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33,
                                         1, 32, 0);
    const __m512i high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
    for (int64_t d = 0; d < head_dim; d += 32) {
        const __m512i a = _mm512_loadu_si512(even + d), b = _mm512_loadu_si512(odd + d);
        _mm512_storeu_si512(dst + 2 * d, _mm512_permutex2var_epi16(a, low, b));
        _mm512_storeu_si512(dst + 2 * d + 32, _mm512_permutex2var_epi16(a, high, b));
    }
}

/* exp(x) for x <= 0 as the bf16 weight takes it, 0 for -inf: 2^n p(r), x = n ln2 + r,
 * |r| <= ln2 / 2, p the series to r^4 (relative error about 4e-5, against the 2^-9 of the
 * bf16 rounding that follows: one fp32 ln2 reduces x closely enough), 2^n applied by
 * vscalefps; below -87 as at -87 (lower would leave denormals, which cost the float unit
 * an assist each). */
static inline __m512 exp_weights(__m512 x) {
    const __mmask16 finite = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_NEQ_UQ);
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693147182f), x);
    __m512 p = _mm512_fmadd_ps(r, _mm512_set1_ps(1.0f / 24), _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_maskz_scalef_ps(finite, p, n);
}

/* One query vector's scores at the block's live tiles (a row of `scores`, as the tile
 * products left them) into weights: scale and bias applied (positions at or past `to` get
 * -inf), the largest score found, exp(s - largest) rounded to bf16 into `weights`, whose
 * sum (lanes by position mod 16, tile by tile, then the lanes in order) is the total. */
static inline __attribute__((always_inline)) void weigh_scores(
    float *scores, uint16_t *weights, const uint16_t *live, int64_t tiles,
    const float *bias_row, const uint16_t *mask_row, int pure, int64_t base, int64_t to,
    float scale, float *largest, float *total) {
    __m512 most = _mm512_set1_ps(-INFINITY);
    const __m512 scales = _mm512_set1_ps(scale);
    for (int64_t i = 0; i < tiles; i++) {
        if (live[i] == 0) continue;
        const __m512 score = _mm512_loadu_ps(scores + 16 * i);
        /* A pure bias adds 0 where the mask is set (the same sum) and -inf elsewhere. */
        const __m512 s =
            pure ? _mm512_mask_blend_ps(mask_row[i], _mm512_set1_ps(-INFINITY),
                                        _mm512_fmadd_ps(score, scales, _mm512_setzero_ps()))
                 : _mm512_fmadd_ps(score, scales,
                                   (__m512)tile_bias(bias_row, base + 16 * i, to));
        _mm512_storeu_ps(scores + 16 * i, s);
        most = _mm512_max_ps(s, most); /* a NaN score never becomes the maximum */
    }
    const float m = _mm512_reduce_max_ps(most);
    __m512 lanes = _mm512_setzero_ps();
    /* Word 2 k + 1 of a lane pair takes bf16 k (word 2 k is zeroed). */
    const __m512i widen_order = _mm512_set_epi16(15, 0, 14, 0, 13, 0, 12, 0, 11, 0, 10, 0, 9, 0,
                                                 8, 0, 7, 0, 6, 0, 5, 0, 4, 0, 3, 0, 2, 0, 1, 0,
                                                 0, 0);
    for (int64_t i = 0; i < tiles; i++) {
        if (live[i] == 0) continue;
        const __m512 e = m == -INFINITY
                             ? _mm512_setzero_ps()
                             : exp_weights(_mm512_sub_ps(_mm512_loadu_ps(scores + 16 * i),
                                                         _mm512_set1_ps(m)));
        const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(e);
        _mm256_storeu_si256((__m256i *)(weights + 16 * i), rounded);
        /* The rounded weights back as floats: each bf16 into its lane's upper half. */
        lanes = _mm512_add_ps(lanes, _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(
                                         0xaaaaaaaau, widen_order, _mm512_castsi256_si512(rounded))));
    }
    float sum = 0.0f;
    for (int p = 0; p < 16; p++) sum += lanes[p];
    *largest = m;
    *total = sum;
}

/* The tile that shares a product of values with tile i (see value_tiles): its neighbour
 * in the pair of sixteen-position tiles that starts at an even multiple of 32 positions,
 * -1 where that neighbour lies outside the task's `tiles` (from position `base`). */
static inline int64_t value_partner(int64_t i, int64_t tiles, int64_t base) {
    const int64_t partner = (base / 16 + i) % 2 == 0 ? i + 1 : i - 1;
    return partner >= 0 && partner < tiles ? partner : -1;
}

/* Four tiles of value sums (outputs `first` .. first + 63) over the block's live tiles.
 * Tiles go in pairs fixed by position (positions 32 m .. 32 m + 31, whatever the task
 * spans): one product of 32 positions a pair (tiles 4 and 5), half the products of one a
 * tile; a pair cut by the task's ends, one product of sixteen (tiles 6 and 7). A dead
 * tile beside a live one weighs exact zeros against finite rows, so a row's sums are the
 * same bits whether its last live tile is paired with a dead one or stands alone. */
static inline __attribute__((always_inline)) void value_tiles(
    const uint16_t *weights, int64_t span, const uint16_t *pairs, const uint16_t *live,
    int64_t tiles, int64_t base, int64_t head_dim, int64_t first, float *sums) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const size_t pair_bytes = (size_t)head_dim * 4;
/* One product per tile of sums: the weights (tile `w`) times 64 output values' pairs
 * (tile `v`, reloaded per sixteen values); tile numbers are immediates: literals only. */
#define VALUE_PRODUCTS(w, v, weight_rows, value_pairs)                                        \
    do {                                                                                      \
        _tile_loadd(w, weight_rows, (size_t)span * 2);                                        \
        _tile_loadd(v, value_pairs, pair_bytes);                                              \
        _tile_dpbf16ps(0, w, v);                                                              \
        _tile_loadd(v, (value_pairs) + 32, pair_bytes);                                       \
        _tile_dpbf16ps(1, w, v);                                                              \
        _tile_loadd(v, (value_pairs) + 64, pair_bytes);                                       \
        _tile_dpbf16ps(2, w, v);                                                              \
        _tile_loadd(v, (value_pairs) + 96, pair_bytes);                                       \
        _tile_dpbf16ps(3, w, v);                                                              \
    } while (0)
    for (int64_t i = 0; i < tiles;) {
        const int64_t partner = value_partner(i, tiles, base);
        const uint16_t *tile_pairs = pairs + i * 16 * head_dim + 2 * first;
        if (partner == i + 1) {
            if (live[i] != 0 || live[i + 1] != 0)
                VALUE_PRODUCTS(4, 5, weights + 16 * i, tile_pairs);
            i += 2;
            continue;
        }
        if (live[i] != 0) VALUE_PRODUCTS(6, 7, weights + 16 * i, tile_pairs);
        i++;
    }
#undef VALUE_PRODUCTS
    const size_t row_bytes = (size_t)head_dim * 4;
    _tile_stored(0, sums + first, row_bytes);
    _tile_stored(1, sums + first + 16, row_bytes);
    _tile_stored(2, sums + first + 32, row_bytes);
    _tile_stored(3, sums + first + 48, row_bytes);
}

/* Tile i's scores of a block of n query vectors (n <= 16) with the sixteen key rows as the
 * A tile where they lie (`key_rows`, rows `row_bytes` apart) against the block's queries
 * transposed into bf16 pairs (`transposed`, a B tile per 32 dimensions): the 16 x 16
 * result (scores_t) transposed into a row of sixteen per query (`scores`, rows `span`
 * apart), or each query's column gathered where few. */
static inline __attribute__((always_inline)) void key_tile_scores(
    const char *key_rows, const uint16_t *transposed, int64_t chunks, size_t row_bytes,
    float *scores_t, float *scores, int64_t i, int64_t span, int64_t n) {
    const __m512i column = _mm512_set_epi32(240, 224, 208, 192, 176, 160, 144, 128, 112, 96,
                                            80, 64, 48, 32, 16, 0);
    _tile_zero(0);
    for (int64_t c = 0; c < chunks; c++) {
        _tile_loadd(4, key_rows + 64 * c, row_bytes);
        _tile_loadd(5, transposed + 512 * c, 64);
        _tile_dpbf16ps(0, 4, 5);
    }
    _tile_stored(0, scores_t, 64);
    if (n > 4) /* query j's scores: column j */
        transpose16((const char *)scores_t, 64, (char *)(scores + 16 * i), (size_t)span * 4);
    else
        for (int64_t j = 0; j < n; j++)
            _mm512_storeu_ps(scores + j * span + 16 * i,
                             _mm512_i32gather_ps(column, scores_t + j, 4));
}

/* The block of query vectors from `first` (n <= 16) ready for its products: padded with
 * zeros to sixteen (and the padding's weights zeroed), the tiles any of its vectors attends
 * to in `live`. Returns the block's queries. */
static inline __attribute__((always_inline)) const uint16_t *prepare_query_block(
    const uint16_t *queries, int64_t first, int64_t n, int64_t head_dim,
    const uint16_t *const *query_masks, const uint16_t *masks, int64_t tiles, int64_t span,
    uint16_t *block_queries, uint16_t *weights, uint16_t *live) {
    const size_t row_bytes = (size_t)head_dim * 2;
    const uint16_t *block = queries + first * head_dim;
    if (n < 16) {
        memcpy(block_queries, block, (size_t)n * row_bytes);
        memset(block_queries + n * head_dim, 0, (size_t)(16 - n) * row_bytes);
        memset(weights + n * span, 0, (size_t)(16 - n) * span * 2);
        block = block_queries;
    }
    for (int64_t i = 0; i < tiles; i++) {
        unsigned mask = 0;
        if (masks[i] != 0)
            for (int64_t j = 0; j < n; j++) mask |= query_masks[first + j][i];
        live[i] = (uint16_t)mask;
    }
    return block;
}

/* attend_range's scores, weights and value sums on tiles for the task's `count` query
 * vectors (queries: [count, head_dim] bf16; query_bias[j]: vector j's bias row), over the
 * live tiles from position `base` (masks: positions any of the task's rows attends to;
 * slots: each position's cache slot, every live tile's dead positions filled with a live
 * one). Leaves each vector's unnormalised sums in acc, its largest score and its total
 * weight. The tiles are configured (attention_tiles_configure) by the caller, once per
 * thread for all its tasks; `scratch`: amx_scratch_bytes(span, head_dim), 64-byte aligned. */
static inline __attribute__((always_inline)) void attend_amx(
    const uint16_t *queries, int64_t count, const float *const *query_bias,
    const uint16_t *const *query_masks, int pure, const char *k_head, const char *v_head,
    const int64_t *slots, const uint16_t *masks,
    int64_t tiles, int64_t base, int64_t to, float scale, int64_t head_dim, float *acc,
    float *max_score, float *total, uint16_t *scratch) {
    const int64_t span = 16 * tiles, chunks = head_dim / 32;
    const size_t row_bytes = (size_t)head_dim * 2;
    if (tiles == 0) { /* nothing attended in this range: weights 0 */
        for (int64_t j = 0; j < count; j++) {
            max_score[j] = -INFINITY;
            total[j] = 0.0f;
        }
        memset(acc, 0, sizeof(float) * (size_t)(count * head_dim));
        return;
    }
    /* scratch (amx_scratch_bytes): keys: each live tile's key rows as B tiles (per 32
     * dimensions, row k holds dimension pair k of the sixteen keys), packed once for every
     * block of queries; pairs: value rows interleaved; block_queries: a last block padded
     * with zeros; scores: [16, span]; weights: [16, span] bf16; sums: [16, head_dim]. */
    uint16_t *keys = scratch, *pairs = keys + span * head_dim;
    uint16_t *block_queries = pairs + span * head_dim;
    float *scores = (float *)(block_queries + 16 * head_dim);
    uint16_t *weights = (uint16_t *)(scores + 16 * span);
    float *sums = (float *)(weights + 16 * span);
    uint16_t copy[16 * head_dim] __attribute__((aligned(64)));
    /* Three blocks of queries or more: the keys packed as B tiles once, each block's scores then
     * a row per query straight from the products. One block (a decode row's few vectors):
     * the keys as A tiles where they lie, against the block's queries packed as B tiles,
     * and each query's column gathered (packing every key tile would cost it more). The
     * same products either way: a score's bits do not depend on which side its key is. */
    const int pack_keys = count > 32;
    const char *key_tiles[tiles + 1];
    uint16_t *transposed = (uint16_t *)(sums + 16 * head_dim);
    float *scores_t = (float *)(transposed + 16 * head_dim);
    /* One block (a decode row's vectors): each tile's scores as soon as its keys are at
     * hand, inside the pass that reads the cache, so the products run while later rows are
     * still on their way from memory (the key rows then come TILE_AHEAD tiles ahead into
     * L1, as the value rows do). */
    const int scores_in_pass = count <= 16;
    uint16_t live[tiles + 1];
    const uint16_t *first_block = NULL;
    if (scores_in_pass) {
        first_block = prepare_query_block(queries, 0, count, head_dim, query_masks, masks,
                                          tiles, span, block_queries, weights, live);
        for (int64_t c = 0; c < chunks; c++)
            transpose16((const char *)(first_block + 32 * c), row_bytes,
                        (char *)(transposed + 512 * c), 64);
    }

    for (int64_t i = 0; i < tiles; i++) {
        if (masks[i] == 0) { /* finite rows for a live neighbour's product (value_tiles) */
            memset(pairs + i * 16 * head_dim, 0, (size_t)(16 * row_bytes));
            continue;
        }
        const int64_t *tile_slots = slots + 16 * i;
        /* A decode row's cache rows come from memory: the value rows TILE_AHEAD tiles on
         * into L1 for this loop; the key rows too where this loop takes the scores, else
         * into L2 for the score products after it. */
        if (i + TILE_AHEAD < tiles && masks[i + TILE_AHEAD] != 0)
            for (int p = 0; p < 16; p++) {
                prefetch_row(v_head, tile_slots[16 * TILE_AHEAD + p], row_bytes);
                if (scores_in_pass)
                    prefetch_row(k_head, tile_slots[16 * TILE_AHEAD + p], row_bytes);
            }
        if (!scores_in_pass)
            for (int p = 0; p < 16; p++) prefetch_row_l2(k_head, tile_slots[p], row_bytes);
        int consecutive = 1;
        for (int p = 1; p < 16; p++) consecutive &= tile_slots[p] == tile_slots[0] + p;
        const char *key_rows = k_head + (size_t)tile_slots[0] * row_bytes;
        if (!consecutive) { /* gathered where they are read: the packing's staging, or keys */
            uint16_t *gathered = pack_keys ? copy : keys + i * 16 * head_dim;
            for (int p = 0; p < 16; p++)
                memcpy(gathered + p * head_dim, k_head + (size_t)tile_slots[p] * row_bytes,
                       row_bytes);
            key_rows = (const char *)gathered;
        }
        if (pack_keys)
            for (int64_t c = 0; c < chunks; c++)
                transpose16(key_rows + 64 * c, row_bytes,
                            (char *)(keys + (i * chunks + c) * 512), 64);
        else
            key_tiles[i] = key_rows;
        if (scores_in_pass && live[i] != 0)
            key_tile_scores(key_rows, transposed, chunks, row_bytes, scores_t, scores, i, span,
                            count);
        for (int k = 0; k < 8; k++)
            interleave_rows((const uint16_t *)(v_head + (size_t)tile_slots[2 * k] * row_bytes),
                            (const uint16_t *)(v_head + (size_t)tile_slots[2 * k + 1] * row_bytes),
                            head_dim, pairs + (i * 8 + k) * 2 * head_dim);
    }

    for (int64_t first = 0; first < count; first += 16) {
        const int64_t n = count - first < 16 ? count - first : 16;
        const uint16_t *block =
            scores_in_pass ? first_block
                           : prepare_query_block(queries, first, n, head_dim, query_masks,
                                                 masks, tiles, span, block_queries, weights,
                                                 live);
        if (scores_in_pass) {
            /* the scores are in place (the pass above) */
        } else if (pack_keys) {
            /* The block's queries (A) against each live tile's packed keys (B): a row of
             * sixteen positions per query, stored in place. */
            for (int64_t i = 0; i < tiles; i++) {
                if (live[i] == 0) continue;
                _tile_zero(0);
                for (int64_t c = 0; c < chunks; c++) {
                    _tile_loadd(4, block + 32 * c, row_bytes);
                    _tile_loadd(5, keys + (i * chunks + c) * 512, 64);
                    _tile_dpbf16ps(0, 4, 5);
                }
                _tile_stored(0, scores + 16 * i, (size_t)span * 4);
            }
        } else {
            for (int64_t c = 0; c < chunks; c++)
                transpose16((const char *)(block + 32 * c), row_bytes,
                            (char *)(transposed + 512 * c), 64);
            for (int64_t i = 0; i < tiles; i++)
                if (live[i] != 0)
                    key_tile_scores(key_tiles[i], transposed, chunks, row_bytes, scores_t,
                                    scores, i, span, n);
        }

        for (int64_t j = 0; j < n; j++)
            weigh_scores(scores + j * span, weights + j * span, live, tiles,
                         query_bias[first + j], query_masks[first + j], pure, base, to, scale,
                         &max_score[first + j], &total[first + j]);

        /* A dead tile paired with a live one weighs zeros (weigh_scores skips it). */
        for (int64_t i = 0; i < tiles; i++) {
            const int64_t partner = value_partner(i, tiles, base);
            if (live[i] == 0 && partner >= 0 && live[partner] != 0)
                for (int64_t j = 0; j < 16; j++)
                    memset(weights + j * span + 16 * i, 0, 32);
        }
        for (int64_t d = 0; d < head_dim; d += 64)
            value_tiles(weights, span, pairs, live, tiles, base, head_dim, d, sums);
        for (int64_t e = 0; e < n * head_dim; e += 16) /* -0 as +0 (see the top) */
            _mm512_storeu_ps(acc + first * head_dim + e,
                             _mm512_add_ps(_mm512_loadu_ps(sums + e), _mm512_setzero_ps()));
    }
}

#endif
