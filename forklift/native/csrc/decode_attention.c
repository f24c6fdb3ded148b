/* Decode attention (paged_attention.h) as one exported call: q and out in bf16 or fp32
 * (io_bf16), the cache in bf16, fp32 or coded rows (format: a CACHE_* value). */
#include "paged_attention.h"

/* Returns 0 on success, 1 when a task's scratch buffer could not be allocated. */
int forklift_decode_attention(const void *q, const void *key_cache, const void *value_cache,
                              const int64_t *blocks, const float *bias, void *out,
                              int64_t seqs, int64_t heads, int64_t kv_heads, int64_t num_blocks,
                              int64_t block_size, int64_t head_dim, int64_t table_width,
                              float scale, int format, int io_bf16, int num_threads) {
#if defined(ATTENTION_TILES)
    if (tiles_cover(head_dim, format)) {
        /* One piece per sequence. */
        int64_t first[seqs], length[seqs];
        for (int64_t s = 0; s < seqs; s++) {
            first[s] = s;
            length[s] = 1;
        }
        return tiled_attention(q, key_cache, value_cache, blocks, bias, out, seqs, heads,
                               kv_heads, num_blocks, block_size, head_dim, table_width, scale,
                               io_bf16, first, length, seqs, num_threads, format);
    }
#endif
    int failed = 0;
    const int64_t tasks = seqs * kv_heads;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) reduction(| : failed)
    for (int64_t task = 0; task < tasks; task++) {
        const int64_t seq = task / kv_heads, kv_head = task % kv_heads;
        /* Common head sizes get their own copy with the size and format constants: fully
         * unrolled row loops, accumulators in registers. */
#define ATTEND(size, form)                                                                  \
    attend_one(q, key_cache, value_cache, blocks, bias, out, seq, kv_head, heads, kv_heads, \
               num_blocks, block_size, size, table_width, scale, form, io_bf16)
        if (head_dim == 64 && format == CACHE_BF16)
            failed |= ATTEND(64, CACHE_BF16);
        else if (head_dim == 128 && format == CACHE_BF16)
            failed |= ATTEND(128, CACHE_BF16);
        else if (head_dim == 64 && format == CACHE_INT8)
            failed |= ATTEND(64, CACHE_INT8);
        else if (head_dim == 128 && format == CACHE_INT8)
            failed |= ATTEND(128, CACHE_INT8);
        else
            failed |= ATTEND(head_dim, format);
#undef ATTEND
    }
    return failed;
}
