/* Decode attention (one query per sequence) straight from the paged KV cache.
 *
 * One task per (sequence, KV head): the task's G = H / Hkv query heads share every key and
 * value row it loads, each row is widened to fp32 once, scores and sums stay in fp32, and
 * masked positions (bias -inf: padding, outside a sliding window) are never loaded. Tasks
 * run on OpenMP threads; the library is linked against the OpenMP runtime torch already
 * loaded, so both share one thread pool.
 *
 * Shapes (row-major, contiguous): q [S, H, D]; key/value cache [Hkv, NB, BS, D];
 * blocks [S, nb] int64 block ids; bias [S, nb * BS] float32; out [S, H, D].
 */
#ifndef FORKLIFT_PAGED_ATTENTION_H
#define FORKLIFT_PAGED_ATTENTION_H

#include "common.h"

/* exp(x) for x <= 0 as plain arithmetic the compiler vectorises (libm's expf is a call per
 * element): 2^n * p(r) with x = n ln2 + r, |r| <= ln2 / 2; relative error about 2e-7. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = floorf(x * 1.44269504f + 0.5f);
    float r = x - n * 0.693145752f - n * 1.42860677e-6f;
    float p = 1.98756912e-4f;
    p = p * r + 1.39819994e-3f;
    p = p * r + 8.33345205e-3f;
    p = p * r + 4.16657962e-2f;
    p = p * r + 1.66666657e-1f;
    p = p * r + 5.0e-1f;
    p = p * r * r + r + 1.0f;
    union { uint32_t u; float f; } scale;
    scale.u = (uint32_t)((int32_t)n + 127) << 23;
    return p * scale.f;
}

/* Rows are fetched this many positions ahead: blocks lie anywhere in the cache, so the
 * hardware prefetcher loses the stream at every block boundary. */
#define PREFETCH_AHEAD 8

static inline void prefetch_row(const char *head, int64_t slot, size_t row_bytes) {
    const char *start = head + (size_t)slot * row_bytes;
    for (size_t offset = 0; offset < row_bytes; offset += 64) __builtin_prefetch(start + offset);
}

/* Sixteen floats as one vector (GCC and clang vector extensions; the compiler splits it
 * into two halves on AVX2). */
typedef float float16_vector __attribute__((vector_size(64)));
typedef int32_t int16_vector __attribute__((vector_size(64)));
#if defined(__clang__)
#define SHUFFLE(v, ...) __builtin_shufflevector(v, v, __VA_ARGS__)
#else
#define SHUFFLE(v, ...) __builtin_shuffle(v, (int16_vector){__VA_ARGS__})
#endif

/* The dot product of two rows of n floats. Sixteen running sums end in a four-step shuffle
 * tree: the compiler's own reduction of a vectorised loop ends in a chain of scalar adds,
 * which was the kernel's critical path. */
static inline float dot(const float *a, const float *b, int64_t n) {
    if (n % 16 != 0) {
        float sum = 0.0f;
        for (int64_t i = 0; i < n; i++) sum += a[i] * b[i];
        return sum;
    }
    float16_vector acc = {0};
    for (int64_t i = 0; i < n; i += 16) {
        float16_vector x, y;
        memcpy(&x, a + i, sizeof x);
        memcpy(&y, b + i, sizeof y);
        acc += x * y;
    }
    acc += SHUFFLE(acc, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    acc += SHUFFLE(acc, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    acc += SHUFFLE(acc, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    acc += SHUFFLE(acc, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    return acc[0];
}

/* acc[h] = sum_t p[h, t] * V[t] for query heads h in [first, first + pass) of the task
 * (heads past `group` get zero weights), with the pass's sums held in registers: head_dim
 * and pass are constants at each call site once inlined. */
static inline __attribute__((always_inline)) void accumulate_values_bf16(
    float *acc, const float *scores, const char *v_head, const int64_t *slots,
    const float *seq_bias, int64_t width, int64_t first, int64_t group, int64_t head_dim,
    int64_t pass) {
    float16_vector sums[4][8] = {{{0}}};
    const int64_t chunks = head_dim / 16;
    for (int64_t t = 0; t < width; t++) {
        if (seq_bias[t] == -INFINITY) continue;
        if (t + PREFETCH_AHEAD < width)
            prefetch_row(v_head, slots[t + PREFETCH_AHEAD], (size_t)head_dim * 2);
        const uint16_t *row = (const uint16_t *)v_head + slots[t] * head_dim;
        float16_vector v[8];
        for (int64_t c = 0; c < chunks; c++) {
            float lanes[16];
            for (int i = 0; i < 16; i++) lanes[i] = bf16_to_float(row[c * 16 + i]);
            memcpy(&v[c], lanes, sizeof lanes);
        }
        for (int64_t h = 0; h < pass; h++) {
            const float p = first + h < group ? scores[(first + h) * width + t] : 0.0f;
            for (int64_t c = 0; c < chunks; c++) sums[h][c] += p * v[c];
        }
    }
    for (int64_t h = 0; h < pass && first + h < group; h++)
        memcpy(acc + (first + h) * head_dim, sums[h], sizeof(float) * (size_t)head_dim);
}

#define LOAD_ROW(dst, src, d_count, is_bf16)                                  \
    do {                                                                      \
        if (is_bf16) {                                                        \
            const uint16_t *row_ = (const uint16_t *)(src);                   \
            _Pragma("omp simd") for (int64_t d_ = 0; d_ < (d_count); d_++)    \
                (dst)[d_] = bf16_to_float(row_[d_]);                          \
        } else {                                                              \
            memcpy((dst), (src), (size_t)(d_count) * sizeof(float));          \
        }                                                                     \
    } while (0)

static inline __attribute__((always_inline)) int attend_one(
                      const void *q, const void *key_cache, const void *value_cache,
                      const int64_t *blocks, const float *bias, void *out, int64_t seq,
                      int64_t kv_head, int64_t heads, int64_t kv_heads, int64_t num_blocks,
                      int64_t block_size, int64_t head_dim, int64_t table_width, float scale,
                      int is_bf16, int io_bf16) {
    const int64_t group = heads / kv_heads;
    const int64_t width = table_width * block_size;
    const size_t elem = is_bf16 ? 2 : 4, io_elem = io_bf16 ? 2 : 4;
    const size_t floats = (size_t)(group * width + 2 * group * head_dim + head_dim);
    float *buffer = malloc(sizeof(float) * floats);
    int64_t *slots = malloc(sizeof(int64_t) * (size_t)width);
    if (buffer == NULL || slots == NULL) {
        free(buffer);
        free(slots);
        return 1;
    }
    float *scores = buffer;                       /* [G, width] */
    float *queries = scores + group * width;      /* [G, D] */
    float *acc = queries + group * head_dim;      /* [G, D] */
    float *row = acc + group * head_dim;          /* [D] */
    const float *seq_bias = bias + seq * width;
    const int64_t *table = blocks + seq * table_width;
    /* Each position's cache slot, computed block by block (a division per position costs
     * more than the position's arithmetic). */
    for (int64_t i = 0; i < table_width; i++)
        for (int64_t j = 0; j < block_size; j++)
            slots[i * block_size + j] = table[i] * block_size + j;
    const size_t first_row = (size_t)((seq * heads + kv_head * group) * head_dim);
    const char *q_base = (const char *)q + first_row * io_elem;

    for (int64_t g = 0; g < group; g++)
        LOAD_ROW(queries + g * head_dim, q_base + (size_t)(g * head_dim) * io_elem, head_dim,
                 io_bf16);

    const size_t row_bytes = (size_t)head_dim * elem;
    const size_t head_stride = (size_t)(num_blocks * block_size * head_dim);
    const char *k_head = (const char *)key_cache + (size_t)kv_head * head_stride * elem;
    const char *v_head = (const char *)value_cache + (size_t)kv_head * head_stride * elem;

    float max_score[group];
    for (int64_t g = 0; g < group; g++) max_score[g] = -INFINITY;
    for (int64_t t = 0; t < width; t++) {
        const float b = seq_bias[t];
        if (b == -INFINITY) {
            for (int64_t g = 0; g < group; g++) scores[g * width + t] = -INFINITY;
            continue;
        }
        const int64_t slot = slots[t];
        if (t + PREFETCH_AHEAD < width) prefetch_row(k_head, slots[t + PREFETCH_AHEAD], row_bytes);
        LOAD_ROW(row, k_head + (size_t)(slot * head_dim) * elem, head_dim, is_bf16);
        for (int64_t g = 0; g < group; g++) {
            const float *qg = queries + g * head_dim;
            const float s = dot(qg, row, head_dim) * scale + b;
            scores[g * width + t] = s;
            if (s > max_score[g]) max_score[g] = s;
        }
    }

    float total[group];
    for (int64_t g = 0; g < group; g++) {
        float *sg = scores + g * width;
        const float m = max_score[g];
        float sum = 0.0f;
        _Pragma("omp simd reduction(+:sum)") for (int64_t t = 0; t < width; t++) {
            const float p = sg[t] == -INFINITY ? 0.0f : exp_nonpositive(sg[t] - m);
            sg[t] = p;
            sum += p;
        }
        total[g] = sum;
    }

    if (is_bf16 && (head_dim == 64 || head_dim == 128)) {
        /* Each pass writes its heads' sums whole: acc needs no clearing. */
        const int64_t heads_per_pass = 256 / head_dim; /* 16 accumulator vectors a pass */
        for (int64_t g = 0; g < group; g += heads_per_pass)
            accumulate_values_bf16(acc, scores, v_head, slots, seq_bias, width, g, group,
                                   head_dim, heads_per_pass);
    } else {
        memset(acc, 0, sizeof(float) * (size_t)(group * head_dim));
        for (int64_t t = 0; t < width; t++) {
            if (seq_bias[t] == -INFINITY) continue;
            const int64_t slot = slots[t];
            if (t + PREFETCH_AHEAD < width)
                prefetch_row(v_head, slots[t + PREFETCH_AHEAD], row_bytes);
            LOAD_ROW(row, v_head + (size_t)(slot * head_dim) * elem, head_dim, is_bf16);
            for (int64_t g = 0; g < group; g++) {
                const float p = scores[g * width + t];
                float *ag = acc + g * head_dim;
                _Pragma("omp simd") for (int64_t d = 0; d < head_dim; d++) ag[d] += p * row[d];
            }
        }
    }

    char *out_base = (char *)out + (size_t)((seq * heads + kv_head * group) * head_dim) * io_elem;
    for (int64_t g = 0; g < group; g++) {
        const float inv = total[g] > 0.0f ? 1.0f / total[g] : 0.0f;
        const float *ag = acc + g * head_dim;
        if (io_bf16) {
            uint16_t *dst = (uint16_t *)out_base + g * head_dim;
            for (int64_t d = 0; d < head_dim; d++) dst[d] = float_to_bf16(ag[d] * inv);
        } else {
            float *dst = (float *)out_base + g * head_dim;
            for (int64_t d = 0; d < head_dim; d++) dst[d] = ag[d] * inv;
        }
    }
    free(buffer);
    free(slots);
    return 0;
}

#endif
