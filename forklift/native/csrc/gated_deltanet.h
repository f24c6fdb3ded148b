/* Gated DeltaNet's token mixer (Qwen3.5's linear-attention layers) on the native step's
 * rows: the short causal convolution and the gated delta rule, between the layer's input
 * projection and its gated output norm (which decode_step.c runs, with the projections).
 *
 * Every token runs the recurrent form, prompt chunks included: a token's state, output and
 * convolution are then the same bits whether it was computed in a prefill chunk, as a
 * decode row or after a state checkpoint, which is what keeps the hybrid family's answers
 * independent of the batch and the cache. A convolution input is rounded to the state
 * slots' dtype as it is made, so the inputs a token's window reads are the same values
 * whether they come from the step or from the slot an earlier step wrote.
 *
 * Rows come in *chains*: consecutive rows of one sequence (a prompt chunk's tokens, a
 * decode row and the rows verifying its drafts). Per row, `reads` names the state slot its
 * chain starts from (-1: it carries on the row before it) and `writes` the slot its state
 * is stored in after it (-1: none). */
#ifndef FORKLIFT_GATED_DELTANET_H
#define FORKLIFT_GATED_DELTANET_H

#include <omp.h>

#include "common.h"
#include "fast_math.h"

typedef struct {
    int64_t key_heads, value_heads, key_dim, value_dim, conv_kernel;
} LinearShape;

/* The convolution's channels per row: queries and keys of every key head, then values. */
static inline int64_t linear_channels(const LinearShape *s) {
    return 2 * s->key_heads * s->key_dim + s->value_heads * s->value_dim;
}

/* One linear layer's own tensors (norms and projections live in StepLayer). */
typedef struct {
    const void *conv_weight;  /* [channels, conv_kernel], model dtype */
    const void *dt_bias;      /* [value_heads], model dtype */
    const void *a_log;        /* [value_heads], model dtype */
    const void *norm;         /* [value_dim]: the gated norm's weight, model dtype */
    void *conv_states;        /* [slots, conv_kernel - 1, channels], model dtype */
    float *recurrent_states;  /* [slots, value_heads, key_dim, value_dim] */
} LinearLayer;

/* log(1 + exp(x)), as torch's softplus (linear above 20). */
static inline float softplus1(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

/* Chains of the rows: first[i], length[i]; returns how many. */
static int64_t linear_chains(const int64_t *reads, int64_t rows, int64_t *first,
                             int64_t *length) {
    int64_t chains = 0;
    for (int64_t r = 0; r < rows; r++) {
        if (reads[r] >= 0 || chains == 0) {
            first[chains] = r;
            length[chains++] = 1;
        } else {
            length[chains - 1]++;
        }
    }
    return chains;
}

/* Channels of one convolution task: a chain's window of each stays in memory the loops
 * stream through (a decode step's chains are one token: blocks of 64 made a task of a few
 * dozen operations). */
#define CONV_CHANNEL_BLOCK 256

/* The depthwise causal convolution and silu over the first `channels` values of each row
 * of `mixed` (row stride `stride`), into out [rows, channels]. Each task takes a chain and
 * a block of channels; the window slides token by token through the chain. Each step runs
 * across the block's channels at once (the loops vectorise), each channel's sum in the
 * same order: its window oldest first, then the new input. */
static void short_conv(const LinearLayer *layer, const float *mixed, int64_t stride,
                       int64_t channels, int64_t kernel, const int64_t *reads,
                       const int64_t *writes, const int64_t *chain_first,
                       const int64_t *chain_length, int64_t chains, int is_bf16, float *out,
                       int num_threads) {
    const int64_t history = kernel - 1, blocks = (channels + CONV_CHANNEL_BLOCK - 1) / CONV_CHANNEL_BLOCK;
    const int64_t slot_size = history * channels;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (chains * blocks > 1)
    for (int64_t task = 0; task < chains * blocks; task++) {
        const int64_t chain = task / blocks, c0 = (task % blocks) * CONV_CHANNEL_BLOCK;
        const int64_t width = channels - c0 < CONV_CHANNEL_BLOCK ? channels - c0 : CONV_CHANNEL_BLOCK;
        float window[history > 0 ? history : 1][CONV_CHANNEL_BLOCK];
        float weight[kernel][CONV_CHANNEL_BLOCK];
        float x[CONV_CHANNEL_BLOCK], sum[CONV_CHANNEL_BLOCK];
        const int64_t first = chain_first[chain];
        for (int64_t j = 0; j < kernel; j++)
            for (int64_t c = 0; c < width; c++)
                weight[j][c] = dtype_value(layer->conv_weight, (c0 + c) * kernel + j, is_bf16);
        for (int64_t j = 0; j < history; j++)
            for (int64_t c = 0; c < width; c++)
                window[j][c] = dtype_value(layer->conv_states,
                                           reads[first] * slot_size + j * channels + c0 + c,
                                           is_bf16);
        for (int64_t t = first; t < first + chain_length[chain]; t++) {
            const float *row = mixed + t * stride + c0;
            if (is_bf16)
                for (int64_t c = 0; c < width; c++) x[c] = bf16_to_float(float_to_bf16(row[c]));
            else
                memcpy(x, row, sizeof(float) * (size_t)width);
            for (int64_t c = 0; c < width; c++) sum[c] = 0.0f;
            for (int64_t j = 0; j < history; j++)
                for (int64_t c = 0; c < width; c++) sum[c] += weight[j][c] * window[j][c];
            for (int64_t c = 0; c < width; c++) sum[c] += weight[history][c] * x[c];
            for (int64_t j = 0; j + 1 < history; j++)
                memcpy(window[j], window[j + 1], sizeof(float) * (size_t)width);
            if (history > 0) memcpy(window[history - 1], x, sizeof(float) * (size_t)width);
            float *dst = out + t * channels + c0;
            for (int64_t c = 0; c < width; c++) dst[c] = sum[c] * sigmoid1(sum[c]);
            if (writes[t] < 0) continue;
            for (int64_t j = 0; j < history; j++)
                for (int64_t c = 0; c < width; c++)
                    store_value(layer->conv_states, writes[t] * slot_size + j * channels + c0 + c,
                                window[j][c], is_bf16);
        }
    }
}

/* x / sqrt(sum x^2 + eps) over n values (the reference's l2norm, eps 1e-6), times `scale`. */
static inline void l2_normalise(const float *x, int64_t n, float scale, float *out) {
    float sum = 0.0f;
    for (int64_t i = 0; i < n; i++) sum += x[i] * x[i];
    const float inverse = scale / sqrtf(sum + 1e-6f);
    for (int64_t i = 0; i < n; i++) out[i] = x[i] * inverse;
}

/* Value columns a pass over the state keeps in registers: DELTA_VECTORS vectors of LANES. */
#define DELTA_VECTORS 8

/* The delta rule's first pass: S <- decay S, and predicted = S^T k, summed over the key
 * dimension's lines in order. A stretch of DELTA_VECTORS vectors of value columns at a
 * time keeps its sums in registers across all the lines (loaded and stored per line, they
 * made the pass twice the memory operations); a narrower tail goes value by value, in the
 * same order. */
static inline void decay_and_predict(float *state, const float *k, float decay, int64_t dk,
                                     int64_t dv, float *predicted) {
    const int64_t span = DELTA_VECTORS * LANES;
    int64_t j0 = 0;
    for (; j0 + span <= dv; j0 += span) {
        lane_vector sums[DELTA_VECTORS];
        for (int c = 0; c < DELTA_VECTORS; c++) sums[c] = (lane_vector){0};
        for (int64_t i = 0; i < dk; i++) {
            float *line = state + i * dv + j0;
            const float ki = k[i];
            for (int c = 0; c < DELTA_VECTORS; c++) {
                lane_vector x;
                memcpy(&x, line + c * LANES, sizeof x);
                x *= decay;
                memcpy(line + c * LANES, &x, sizeof x);
                sums[c] += ki * x;
            }
        }
        memcpy(predicted + j0, sums, sizeof sums);
    }
    for (int64_t j = j0; j < dv; j++) predicted[j] = 0.0f;
    for (int64_t i = 0; i < dk && j0 < dv; i++) {
        float *line = state + i * dv;
        const float ki = k[i];
        for (int64_t j = j0; j < dv; j++) {
            line[j] *= decay;
            predicted[j] += ki * line[j];
        }
    }
}

/* The second pass: S <- S + k correction^T, and o = S^T q, stretch by stretch as
 * decay_and_predict. */
static inline void correct_and_read(float *state, const float *k, const float *q,
                                    const float *correction, int64_t dk, int64_t dv,
                                    float *o) {
    const int64_t span = DELTA_VECTORS * LANES;
    int64_t j0 = 0;
    for (; j0 + span <= dv; j0 += span) {
        lane_vector fix[DELTA_VECTORS], sums[DELTA_VECTORS];
        memcpy(fix, correction + j0, sizeof fix);
        for (int c = 0; c < DELTA_VECTORS; c++) sums[c] = (lane_vector){0};
        for (int64_t i = 0; i < dk; i++) {
            float *line = state + i * dv + j0;
            const float ki = k[i], qi = q[i];
            for (int c = 0; c < DELTA_VECTORS; c++) {
                lane_vector x;
                memcpy(&x, line + c * LANES, sizeof x);
                x += ki * fix[c];
                memcpy(line + c * LANES, &x, sizeof x);
                sums[c] += qi * x;
            }
        }
        memcpy(o + j0, sums, sizeof sums);
    }
    for (int64_t j = j0; j < dv; j++) o[j] = 0.0f;
    for (int64_t i = 0; i < dk && j0 < dv; i++) {
        float *line = state + i * dv;
        const float ki = k[i], qi = q[i];
        for (int64_t j = j0; j < dv; j++) {
            line[j] += ki * correction[j];
            o[j] += qi * line[j];
        }
    }
}

/* The gated delta rule, one task per (chain, value head), token by token:
 *   S <- exp(g) S;  S <- S + k (beta (v - S^T k))^T;  o = S^T q
 * with q, k the L2-normalised convolution outputs of the head's key head (q also scaled by
 * key_dim^-1/2), beta = sigmoid(b) and g = -exp(A_log) softplus(a + dt_bias) from the
 * projection's last 2 value_heads values of the row. S is float32 [key_dim, value_dim]; its
 * two passes run along value_dim, so each output sums over key_dim in one fixed order.
 * conv: [rows, channels] (queries, keys, values); out: [rows, value_heads * value_dim].
 * Returns 1 when its scratch could not be allocated. */
static int delta_rule(const LinearLayer *layer, const LinearShape *s, const float *conv,
                      const float *projection, int64_t stride, int64_t channels,
                      const int64_t *reads, const int64_t *writes, const int64_t *chain_first,
                      const int64_t *chain_length, int64_t chains, int is_bf16, float *out,
                      int num_threads) {
    const int64_t dk = s->key_dim, dv = s->value_dim, heads = s->value_heads;
    const int64_t group = heads / s->key_heads, key_size = s->key_heads * dk;
    const int64_t head_state = dk * dv, per_thread = head_state + 2 * dk + 2 * dv;
    const int64_t beta_at = channels + heads * dv, decay_at = beta_at + heads;
    float *scratch = malloc(sizeof(float) * (size_t)(per_thread * num_threads));
    if (scratch == NULL) return 1;
    const float q_scale = 1.0f / sqrtf((float)dk);
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (chains * heads > 1)
    for (int64_t task = 0; task < chains * heads; task++) {
        const int64_t chain = task / heads, h = task % heads, key_head = h / group;
        float *own = scratch + per_thread * omp_get_thread_num();
        float *q = own + head_state, *k = q + dk, *predicted = k + dk, *correction = predicted + dv;
        const int64_t first = chain_first[chain];
        const float decay_rate = -expf(dtype_value(layer->a_log, h, is_bf16));
        const float dt_bias = dtype_value(layer->dt_bias, h, is_bf16);
        float *slot = layer->recurrent_states + (reads[first] * heads + h) * head_state;
        /* A decode row that stores its state where it read it updates the slot in place:
         * the same operations on the same values, without copying the state in and out
         * (a third of the memory traffic of the state, which outgrows the caches). */
        const int in_place =
            chain_length[chain] == 1 && reads[first] >= 0 && writes[first] == reads[first];
        float *state = in_place ? slot : own;
        if (!in_place) memcpy(state, slot, sizeof(float) * (size_t)head_state);
        for (int64_t t = first; t < first + chain_length[chain]; t++) {
            const float *row = conv + t * channels;
            const float *v = row + 2 * key_size + h * dv;
            l2_normalise(row + key_head * dk, dk, q_scale, q);
            l2_normalise(row + key_size + key_head * dk, dk, 1.0f, k);
            const float *p = projection + t * stride;
            const float beta = sigmoid1(p[beta_at + h]);
            const float decay = expf(decay_rate * softplus1(p[decay_at + h] + dt_bias));
            decay_and_predict(state, k, decay, dk, dv, predicted);
            for (int64_t j = 0; j < dv; j++) correction[j] = (v[j] - predicted[j]) * beta;
            correct_and_read(state, k, q, correction, dk, dv,
                             out + t * heads * dv + h * dv);
            if (writes[t] >= 0 && !in_place)
                memcpy(layer->recurrent_states + (writes[t] * heads + h) * head_state, state,
                       sizeof(float) * (size_t)head_state);
        }
    }
    free(scratch);
    return 0;
}

/* The convolution then the delta rule over a projection's rows [rows, stride] (per row the
 * convolution's inputs: queries, keys, values; then the output gate z, beta's and the
 * decay's logits); conv_out [rows, channels] is scratch; out [rows, value_heads *
 * value_dim] gets each head's output, before the gated norm. Returns 1 when scratch could
 * not be allocated. */
static int linear_mixer(const LinearLayer *layer, const LinearShape *s, const float *projection,
                        int64_t stride, int64_t rows, const int64_t *reads,
                        const int64_t *writes, int is_bf16, float *conv_out, float *out,
                        int num_threads) {
    const int64_t channels = linear_channels(s);
    int64_t *chain_first = malloc(sizeof(int64_t) * (size_t)(2 * rows));
    if (chain_first == NULL) return 1;
    int64_t *chain_length = chain_first + rows;
    const int64_t chains = linear_chains(reads, rows, chain_first, chain_length);
    short_conv(layer, projection, stride, channels, s->conv_kernel, reads, writes, chain_first,
               chain_length, chains, is_bf16, conv_out, num_threads);
    const int failed = delta_rule(layer, s, conv_out, projection, stride, channels, reads, writes,
                                  chain_first, chain_length, chains, is_bf16, out, num_threads);
    free(chain_first);
    return failed;
}

#endif
