/* Decode attention (paged_attention.h) as one exported call: q and out in the cache's
 * dtype. */
#include "attention_tiles.h"

/* Returns 0 on success, 1 when a task's scratch buffer could not be allocated. */
int forklift_decode_attention(const void *q, const void *key_cache, const void *value_cache,
                              const int64_t *blocks, const float *bias, void *out,
                              int64_t seqs, int64_t heads, int64_t kv_heads, int64_t num_blocks,
                              int64_t block_size, int64_t head_dim, int64_t table_width,
                              float scale, int is_bf16, int num_threads) {
#if defined(ATTENTION_TILES)
    if (tiles_cover(head_dim, is_bf16)) {
        /* One piece per sequence. */
        int64_t first[seqs], length[seqs];
        for (int64_t s = 0; s < seqs; s++) {
            first[s] = s;
            length[s] = 1;
        }
        return tiled_attention(q, key_cache, value_cache, blocks, bias, out, seqs, heads,
                               kv_heads, num_blocks, block_size, head_dim, table_width, scale,
                               1, first, length, seqs, num_threads);
    }
#endif
    int failed = 0;
    const int64_t tasks = seqs * kv_heads;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) reduction(| : failed)
    for (int64_t task = 0; task < tasks; task++) {
        const int64_t seq = task / kv_heads, kv_head = task % kv_heads;
        /* Common head sizes get their own copy with the size a constant: fully unrolled
         * row loops, accumulators in registers. */
        if (head_dim == 64 && is_bf16)
            failed |= attend_one(q, key_cache, value_cache, blocks, bias, out, seq, kv_head,
                                 heads, kv_heads, num_blocks, block_size, 64, table_width,
                                 scale, 1, 1);
        else if (head_dim == 128 && is_bf16)
            failed |= attend_one(q, key_cache, value_cache, blocks, bias, out, seq, kv_head,
                                 heads, kv_heads, num_blocks, block_size, 128, table_width,
                                 scale, 1, 1);
        else
            failed |= attend_one(q, key_cache, value_cache, blocks, bias, out, seq, kv_head,
                                 heads, kv_heads, num_blocks, block_size, head_dim,
                                 table_width, scale, is_bf16, is_bf16);
    }
    return failed;
}
