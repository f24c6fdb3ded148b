/* A whole decode step of a Llama-family model in one call: embedding, every layer (RMSNorm,
 * fused QKV, q/k norms, rotary, the K/V write into the paged cache, paged attention, o_proj
 * and residual, RMSNorm, gate-up, SiLU x up, down and residual), the final norm and the
 * logits. Python prepares the step's index tensors once and calls this once, so no
 * interpreter or operator dispatch stands between the layers.
 *
 * Gemma 3 runs the same loop with its differences switched on: norms scaling by 1 + w, the
 * outputs of attention and MLP normed before their residual adds, a tanh-GELU gate, a scaled
 * embedding, and per layer its own rotary table and KV group (a sliding-window layer reads
 * its group's blocks, window-masked, and writes its own slots).
 *
 * Every linear is a block-quantized weight (quant_matmul.h) or, where the CPU has AMX or
 * AVX512-BF16, a dense bf16 one in tiles (dense_matmul.h: RL rollouts' pushed weights); norms
 * and the embedding are in the model's dtype (bf16 or fp32), the KV cache in bf16 or fp32 (bf16
 * under an fp32 model by default) or in rows of one-byte codes with a scale each
 * (paged_attention.h's coded formats), converted or quantized as they are written. A row
 * running a LoRA adapter adds its slot's delta to each projection it adapts (float32 slots,
 * see lora_add). The residual
 * stream and every activation stay in fp32 between operations. Each matmul and the
 * attention fan out over the OpenMP threads torch uses; the small per-row operations run on
 * the calling thread below ROW_PARALLEL_MIN rows, on every thread from there.
 */
#include "paged_attention.h"
#include "dense_matmul.h"
#include "gated_deltanet.h"
#include "quant_matmul.h"

/* Rows from which the per-row work (norms, rotary and the K/V write, the gate) fans out over
 * the threads: an RL rollout's 64 rows spend milliseconds a step there on one thread, while
 * a few rows would pay more to start the threads than they save. */
#define ROW_PARALLEL_MIN 8

/* 1 where dense bf16 weights can run here (AMX tiles compiled in and granted, or AVX512-BF16
 * dot products compiled in). */
int forklift_decode_step_dense_tiles(void) { return dense_tiles_available(); }

/* One projection: dense tiles or quantized blocks. dense_x: bf16 scratch for dense rows.
 * Returns 1 when its scratch could not be allocated. */
static int step_matmul(const QuantWeight *w, const float *x, int64_t rows,
                       QuantizedRow *views, float *rest, uint16_t *dense_x, float *out,
                       int num_threads) {
#if defined(FORKLIFT_DENSE_NATIVE)
    if (w->dense) {
        dense_matmul_rows((const uint16_t *)w->codes, w->n, w->k, x, rows, dense_x, out,
                          num_threads);
        return 0;
    }
#else
    (void)dense_x;
#endif
    return quant_matmul_rows(w, x, rows, views, rest, out, num_threads);
}

/* One projection's LoRA slots (forklift/model/layers/lora_weights.py); a == NULL: none. */
typedef struct {
    const float *a;             /* [slots, slices * max_rank, in] */
    const float *b;             /* [slots, max_rank, out]: each output's own slice's ranks */
    const int64_t *ranks;       /* [slots, slices]: 0 where a slice is not adapted */
    const int64_t *slice_starts; /* [slices + 1] output offsets */
    int64_t slices, max_rank;
} StepLoRA;

typedef struct {
    const void *input_norm;  /* [hidden] */
    const void *post_norm;   /* [hidden] */
    const void *q_norm;      /* [head_dim] or NULL */
    const void *k_norm;      /* [head_dim] or NULL */
    const void *qkv_bias;    /* [q + 2 kv] or NULL */
    const void *o_bias;      /* [hidden] or NULL */
    QuantWeight qkv, o, gate_up, down;
    void *key_cache;         /* [kv_heads, num_blocks, block_size, head_dim] */
    void *value_cache;
    const void *attn_out_norm; /* [hidden] or NULL: norms o_proj's output (Gemma 3) */
    const void *mlp_out_norm;  /* [hidden] or NULL: norms down's output (Gemma 3) */
    const float *rope_cos;   /* [max_positions, rotary_dim], rotate-half: this layer's table */
    const float *rope_sin;
    int64_t group;           /* the KV group whose slots, blocks and mask this layer uses */
    StepLoRA lora_qkv, lora_o, lora_gate_up, lora_down;
    int64_t kind;            /* LAYER_ATTENTION or LAYER_LINEAR */
    int64_t output_gate;     /* attention: q_proj also yields a gate per head (Qwen3.5) */
    LinearLayer linear;      /* LAYER_LINEAR: qkv is in_proj, o is out_proj */
} StepLayer;

/* A layer's token mixer: paged attention, or Gated DeltaNet (gated_deltanet.h). */
#define LAYER_ATTENTION 0
#define LAYER_LINEAR 1

/* One KV group's step metadata (see forklift_decode_step). */
typedef struct {
    const int64_t *slots;
    const int64_t *blocks;
    int64_t table_width;
    const float *bias;
} StepGroup;

typedef struct {
    int64_t num_layers, hidden, heads, kv_heads, head_dim, intermediate, vocab, rotary_dim;
    int64_t num_blocks, block_size;
    float eps, scale;
    int is_bf16;             /* norms, embedding and KV cache in bf16 (else fp32) */
    const void *embed;       /* [vocab, hidden] */
    const void *final_norm;  /* [hidden] */
    QuantWeight head;        /* [vocab, hidden] */
    const StepLayer *layers;
    float norm_offset;       /* norms scale by norm_offset + w: 0, or 1 for Gemma */
    float embed_scale;       /* the embedding times this, rounded to the dtype; 0: none */
    int gelu;                /* the MLP gates with tanh-GELU (else SiLU) */
    QuantWeight embed_blocks; /* embed NULL: the embedding is the tied head's q8 blocks */
    int cache_format;        /* the KV cache's CACHE_* (paged_attention.h) */
    LinearShape linear;      /* the linear layers' shape (a hybrid model) */
    /* Qwen3.5's MTP layer bound as a model: with input_fc set (k = 2 hidden), a row's input
     * is fc([norm_e(embedding); norm_h(its input hidden state)]), not the embedding alone. */
    QuantWeight input_fc;
    const void *input_norm_embedding; /* [hidden] */
    const void *input_norm_hidden;    /* [hidden] */
} StepModel;

/* Input i of row n of a q8 block weight (quant_matmul.h's layout): code times its block's
 * scale, exactly the file's value for a Q8_0 embedding. */
static inline float embedding_from_blocks(const QuantWeight *w, int64_t n, int64_t i) {
    const int64_t blocks = w->k / QK, g = n / 8, lane = n % 8, b = i / QK, c = (i % QK) / 4;
    const int8_t code =
        ((const int8_t *)w->codes)[(g * blocks + b) * 256 + c * 32 + 4 * lane + i % 4];
    return (float)code * fp16_to_float(w->d[(g * blocks + b) * 8 + lane]);
}

/* out = x / rms(x) * (offset + w) over n values. The squares sum in vector lanes (one
 * running sum is a chain of n dependent adds: an RL rollout's 64 rows spent about a
 * millisecond a step on it), and each dtype's loop vectorises on its own. */
static void rms_norm(const float *x, const void *weight, int64_t n, float eps, int is_bf16,
                     float offset, float *out) {
    const float inverse = 1.0f / sqrtf(vector_dot(x, x, n) / (float)n + eps);
    if (is_bf16) {
        const uint16_t *w = weight;
        for (int64_t i = 0; i < n; i++) out[i] = x[i] * inverse * (offset + bf16_to_float(w[i]));
    } else {
        const float *w = weight;
        for (int64_t i = 0; i < n; i++) out[i] = x[i] * inverse * (offset + w[i]);
    }
}

/* sigmoid(z), LANES lanes, with exp taken of -|z| only (no overflow):
 * 1 / (1 + e) for z >= 0, e / (1 + e) below, e = exp(-|z|). */
static inline lane_vector sigmoid_lanes(lane_vector z) {
    const lane_int_vector negative = z < 0.0f;
    const lane_int_vector sign_bit = (lane_int_vector){0} + INT32_MIN;
    const lane_vector e = exp_nonpositive_lanes((lane_vector)((lane_int_vector)z | sign_bit));
    const lane_vector one = e - e + 1.0f;
    const lane_vector numerator =
        (lane_vector)(((lane_int_vector)e & negative) | ((lane_int_vector)one & ~negative));
    return numerator / (one + e);
}

/* act = silu(gate) * up = gate * sigmoid(gate) * up over n values. `act` may be `gate`. */
static void silu_mul(const float *gate, const float *up, int64_t n, float *act) {
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        lane_vector g, u;
        memcpy(&g, gate + i, sizeof g);
        memcpy(&u, up + i, sizeof u);
        const lane_vector result = g * sigmoid_lanes(g) * u;
        memcpy(act + i, &result, sizeof result);
    }
    for (; i < n; i++) act[i] = gate[i] * sigmoid1(gate[i]) * up[i];
}

/* act = gelu_tanh(gate) * up over n values: gelu_tanh(g) = 0.5 g (1 + tanh y) with
 * y = sqrt(2 / pi) (g + 0.044715 g^3), which is g * sigmoid(2 y). `act` may be `gate`. */
static void gelu_tanh_mul(const float *gate, const float *up, int64_t n, float *act) {
    const float twice_c = 2.0f * 0.7978845608028654f, cubic = 0.044715f;
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        lane_vector g, u;
        memcpy(&g, gate + i, sizeof g);
        memcpy(&u, up + i, sizeof u);
        const lane_vector result = g * sigmoid_lanes(twice_c * (g + cubic * g * g * g)) * u;
        memcpy(act + i, &result, sizeof result);
    }
    for (; i < n; i++) {
        const float g = gate[i];
        act[i] = g * sigmoid1(twice_c * (g + cubic * g * g * g)) * up[i];
    }
}

/* Outputs per task of a LoRA expansion: a few cache lines of each B row. */
#define LORA_OUTPUT_CHUNK 128

/* y[r] += x[r] @ A_s.T @ B_s.T for each row r whose adapter slot s = row_lora[r] >= 0, slice
 * by slice (an output reads only its own slice's ranks). The shrink is a dot product per
 * (row, adapted rank), each A row read once for all rows of its slot; the expansion runs
 * along B's rows ([rank, out] per slot), so its inner loop is a plain multiply-add over
 * contiguous outputs. One parallel region: shrink, barrier,
 * expansion in chunks of outputs. Returns 1 when its scratch could not be allocated. */
static int lora_add(const StepLoRA *lora, const float *x, int64_t in, int64_t out,
                    int64_t rows, const int64_t *row_lora, float *y, int num_threads) {
    if (lora->a == NULL || row_lora == NULL) return 0;
    const int64_t slices = lora->slices, max_rank = lora->max_rank, width = slices * max_rank;
    const int64_t *ranks = lora->ranks, *starts = lora->slice_starts;
    /* The shrink's tasks: each (slot in use, adapted rank), so an A row is read once for
     * all the rows of its slot and the threads share the work evenly. */
    /* On the heap: a prefill chunk's rows times the ranks would overflow a thread's stack. */
    int64_t *task_slot = malloc(sizeof(int64_t) * (size_t)(2 * rows * width));
    float *shrunk = malloc(sizeof(float) * (size_t)(rows * width));
    if (task_slot == NULL || shrunk == NULL) {
        free(task_slot);
        free(shrunk);
        return 1;
    }
    int64_t *task_column = task_slot + rows * width, tasks = 0;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t slot = row_lora[r];
        int64_t earlier = 0;
        while (earlier < r && row_lora[earlier] != slot) earlier++;
        if (slot < 0 || earlier < r) continue; /* the base's row, or a slot already listed */
        for (int64_t column = 0; column < width; column++)
            if (column % max_rank < ranks[slot * slices + column / max_rank]) {
                task_slot[tasks] = slot;
                task_column[tasks++] = column;
            }
    }
    if (tasks == 0) {
        free(task_slot);
        free(shrunk);
        return 0;
    }
    const int64_t chunks = (out + LORA_OUTPUT_CHUNK - 1) / LORA_OUTPUT_CHUNK;
#pragma omp parallel num_threads(num_threads) if (rows * (in + out) * max_rank > 32768)
    {
#pragma omp for schedule(static)
        for (int64_t task = 0; task < tasks; task++) {
            const int64_t slot = task_slot[task], column = task_column[task];
            const float *a = lora->a + (slot * width + column) * in;
            for (int64_t r = 0; r < rows; r++)
                if (row_lora[r] == slot) shrunk[r * width + column] = vector_dot(a, x + r * in, in);
        }
#pragma omp for schedule(static)
        for (int64_t chunk = 0; chunk < chunks; chunk++) {
            const int64_t first = chunk * LORA_OUTPUT_CHUNK;
            const int64_t last = first + LORA_OUTPUT_CHUNK < out ? first + LORA_OUTPUT_CHUNK : out;
            for (int64_t r = 0; r < rows; r++) {
                const int64_t slot = row_lora[r];
                if (slot < 0) continue;
                float *row = y + r * out;
                for (int64_t i = 0; i < slices; i++) {
                    const int64_t from = first > starts[i] ? first : starts[i];
                    const int64_t to = last < starts[i + 1] ? last : starts[i + 1];
                    const int64_t rank = ranks[slot * slices + i];
                    const float *t = shrunk + r * width + i * max_rank;
                    for (int64_t j = 0; j < rank && from < to; j++) {
                        const float *b = lora->b + (slot * max_rank + j) * out;
                        const float tj = t[j];
                        for (int64_t o = from; o < to; o++) row[o] += tj * b[o];
                    }
                }
            }
        }
    }
    free(task_slot);
    free(shrunk);
    return 0;
}

/* Rotate-half rotary on the first `rotary_dim` values of one head. */
static inline void rotate(float *head, const float *cos, const float *sin, int64_t rotary_dim) {
    const int64_t half = rotary_dim / 2;
    for (int64_t i = 0; i < half; i++) {
        const float a = head[i], b = head[i + half];
        head[i] = a * cos[i] - b * sin[i];
        head[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

/* Most rows of one attention task: a prefill chunk's rows share its blocks, and a task's
 * scores ([rows x query heads per KV head, positions]) should stay within L2. */
#define PIECE_MAX_ROWS 32

/* Attention tasks: runs of consecutive rows reading the same blocks (a sequence's rows
 * verifying its drafts or computing a prompt chunk share every key and value row loaded),
 * at most PIECE_MAX_ROWS long, cut into pieces so that the
 * threads get at least two tasks each where the rows allow, times the KV heads. first[i]
 * and length[i] describe piece i; returns the number of pieces. */
static int64_t attention_pieces(const int64_t *blocks, int64_t rows, int64_t table_width,
                                int64_t kv_heads, int num_threads, int64_t *first,
                                int64_t *length) {
    int64_t runs = 0;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t *table = blocks + r * table_width;
        if (r > 0 && length[runs - 1] < PIECE_MAX_ROWS &&
            memcmp(table, table - table_width, sizeof(int64_t) * table_width) == 0) {
            length[runs - 1]++;
        } else {
            first[runs] = r;
            length[runs++] = 1;
        }
    }
    const int64_t wanted = 2 * (int64_t)num_threads;
    int64_t pieces = runs;
    /* Halve the longest pieces until there are enough tasks (or every piece is one row). */
    while (pieces * kv_heads < wanted) {
        int64_t longest = 0;
        for (int64_t i = 1; i < pieces; i++)
            if (length[i] > length[longest]) longest = i;
        if (length[longest] < 2) break;
        const int64_t half = length[longest] / 2;
        first[pieces] = first[longest] + length[longest] - half;
        length[pieces++] = half;
        length[longest] -= half;
    }
    return pieces;
}

static void attention(const StepModel *m, const StepLayer *layer, const float *q, int64_t rows,
                      const StepGroup *group, float *out, int num_threads, int *failed) {
    const int64_t *blocks = group->blocks, table_width = group->table_width;
    const float *bias = group->bias;
    int64_t first[rows], length[rows];
    const int64_t pieces = attention_pieces(blocks, rows, table_width, m->kv_heads,
                                            num_threads, first, length);
    const int format = m->cache_format;
#if defined(ATTENTION_TILES)
    if (tiles_cover(m->head_dim, format)) {
        *failed |= tiled_attention(q, layer->key_cache, layer->value_cache, blocks, bias, out,
                                   rows, m->heads, m->kv_heads, m->num_blocks, m->block_size,
                                   m->head_dim, table_width, m->scale, 0, first, length,
                                   pieces, num_threads, format);
        return;
    }
#endif
    const int64_t tasks = pieces * m->kv_heads;
    int task_failed = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) reduction(| : task_failed)
    for (int64_t task = 0; task < tasks; task++) {
        /* Last pieces first: a prompt chunk's later rows attend to more positions, and the
         * heaviest tasks taken last leave the other threads waiting. */
        const int64_t piece = pieces - 1 - task / m->kv_heads, kv_head = task % m->kv_heads;
        const int64_t row = first[piece], count = length[piece];
        /* Common head sizes get their own copy with the size and format constants. */
#define ATTEND(size, form)                                                                   \
    attend_rows(q, layer->key_cache, layer->value_cache, blocks, bias, out, row, count,     \
                kv_head, m->heads, m->kv_heads, m->num_blocks, m->block_size, size,         \
                table_width, m->scale, form, 0)
        if (format == CACHE_BF16 && m->head_dim == 64)
            task_failed |= ATTEND(64, CACHE_BF16);
        else if (format == CACHE_BF16 && m->head_dim == 128)
            task_failed |= ATTEND(128, CACHE_BF16);
        else if (format == CACHE_BF16 && m->head_dim == 256)
            task_failed |= ATTEND(256, CACHE_BF16);
        else if (format == CACHE_INT8 && m->head_dim == 64)
            task_failed |= ATTEND(64, CACHE_INT8);
        else if (format == CACHE_INT8 && m->head_dim == 128)
            task_failed |= ATTEND(128, CACHE_INT8);
        else
            task_failed |= ATTEND(m->head_dim, format);
#undef ATTEND
    }
    *failed |= task_failed;
}

/* Seconds spent in matmuls (activation quantization included) and in attention, added to
 * timings[0] and [1] when the caller passes timings; [2] gets the rest of the step. */
#define TIMED(slot, call)                                                                 \
    do {                                                                                  \
        const double started_ = timings != NULL ? omp_get_wtime() : 0.0;                 \
        call;                                                                             \
        if (timings != NULL) timings[slot] += omp_get_wtime() - started_;                 \
    } while (0)

static inline int64_t larger(int64_t a, int64_t b) { return a > b ? a : b; }

/* A Gated DeltaNet layer between its projections: the mixer (gated_deltanet.h), then the
 * gated output norm per value head, rms_norm(o) * w * silu(z), z the projection's gate
 * values after the convolution's inputs. Returns 1 when scratch could not be allocated. */
static int gated_deltanet(const LinearLayer *layer, const LinearShape *s,
                          const float *projection, int64_t stride, int64_t rows,
                          const int64_t *reads, const int64_t *writes, float eps, int is_bf16,
                          float *conv_out, float *out, int num_threads) {
    if (linear_mixer(layer, s, projection, stride, rows, reads, writes, is_bf16, conv_out, out,
                     num_threads))
        return 1;
    const int64_t dv = s->value_dim, heads = s->value_heads;
    const int64_t channels = linear_channels(s);
#pragma omp parallel for num_threads(num_threads) if (rows >= ROW_PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t h = 0; h < heads; h++) {
            float *o = out + (r * heads + h) * dv;
            const float *z = projection + r * stride + channels + h * dv;
            rms_norm(o, layer->norm, dv, eps, is_bf16, 0.0f, o);
            for (int64_t j = 0; j < dv; j++) o[j] *= z[j] * sigmoid1(z[j]);
        }
    return 0;
}

static int step_rows(const StepModel *m, int64_t rows, const int64_t *ids,
                     const int64_t *positions, const StepGroup *groups, float *logits,
                     int num_threads, double *timings, const int64_t *row_lora,
                     const int64_t *logit_rows, int64_t num_logits, float *hidden_out,
                     const int64_t *state_reads, const int64_t *state_writes,
                     const float *input_hidden) {
    const double step_started = timings != NULL ? omp_get_wtime() : 0.0;
    const double timed_before = timings != NULL ? timings[0] + timings[1] : 0.0;
    const int64_t hidden = m->hidden, head_dim = m->head_dim;
    const int64_t q_size = m->heads * head_dim, kv_size = m->kv_heads * head_dim;
    const int64_t qkv_size = q_size + 2 * kv_size, inter = m->intermediate;
    const LinearShape *shape = &m->linear;
    const int64_t value_size = shape->value_heads * shape->value_dim;
    const int64_t channels = linear_channels(shape);
    /* The widest first projection (a gated q_proj, a linear layer's in_proj), the widest
     * mixer output (queries, or a linear layer's values) and the widest matmul input. */
    int64_t projection = qkv_size;
    for (int64_t l = 0; l < m->num_layers; l++) projection = larger(projection, m->layers[l].qkv.n);
    const int64_t mixed = larger(q_size, channels);
    /* An MTP input's joined rows [rows, 2 hidden] take the MLP's scratch before any layer. */
    const int64_t joined_width = m->input_fc.k;
    const int64_t widest =
        larger(larger(larger(inter, q_size), larger(hidden, value_size)), joined_width);
    const int64_t mlp_span = larger(3 * inter, joined_width);
    const size_t floats = (size_t)(rows * (2 * hidden + projection + mixed +
                                           larger(q_size, value_size) + mlp_span) +
                                   widest);
    /* A model's weights are all dense or all blocks; dense ones need a dense kernel. */
    const int dense = m->head.dense;
#if !defined(FORKLIFT_DENSE_NATIVE)
    if (dense) return 2;
#endif
    float *residual = aligned_alloc(64, (sizeof(float) * floats + 63) / 64 * 64);
    QuantizedRow *views = malloc(sizeof(QuantizedRow) * (size_t)(2 * rows));
    int8_t *scratch = views == NULL ? NULL : quantized_rows_alloc(2 * rows, widest, views);
    /* Dense weights' inputs as bf16. */
    uint16_t *dense_x =
        dense ? malloc(sizeof(uint16_t) * (size_t)dense_scratch_elements(rows, widest)) : NULL;
    if (residual == NULL || views == NULL || scratch == NULL || (dense && dense_x == NULL)) {
        free(residual);
        free(views);
        free(scratch);
        free(dense_x);
        return 1;
    }
    float *normed = residual + rows * hidden;     /* [rows, hidden] */
    float *qkv = normed + rows * hidden;          /* [rows, the layer's first projection] */
    float *attended = qkv + rows * projection;    /* [rows, q], or a linear layer's conv */
    float *gated = attended + rows * mixed;       /* [rows, q] gates, or [rows, values] */
    float *gate_up = gated + rows * larger(q_size, value_size); /* [rows, 2 inter] */
    float *activated = gate_up + rows * 2 * inter; /* [rows, inter]; rows run in parallel */
    float *rest = gate_up + rows * mlp_span;      /* [widest]: precise weights' residuals */
    const int is_bf16 = m->is_bf16;
    int failed = 0;

    const float offset = m->norm_offset;
    /* The scale as the model's dtype holds it, and each product rounded to that dtype too
     * (the reference scales the embedding lookup in the dtype). */
    const float embed_scale = is_bf16 ? bf16_to_float(float_to_bf16(m->embed_scale))
                                      : m->embed_scale;
#pragma omp parallel for num_threads(num_threads) if (rows >= ROW_PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < hidden; i++) {
            float v = m->embed != NULL ? dtype_value(m->embed, ids[r] * hidden + i, is_bf16)
                                       : embedding_from_blocks(&m->embed_blocks, ids[r], i);
            /* As the dense embedding held it: in the model's dtype. */
            if (m->embed == NULL && is_bf16) v = bf16_to_float(float_to_bf16(v));
            if (embed_scale != 0.0f) {
                v *= embed_scale;
                if (is_bf16) v = bf16_to_float(float_to_bf16(v));
            }
            residual[r * hidden + i] = v;
        }
    if (joined_width > 0) {
        float *joined = gate_up;
#pragma omp parallel for num_threads(num_threads) if (rows >= ROW_PARALLEL_MIN)
        for (int64_t r = 0; r < rows; r++) {
            rms_norm(residual + r * hidden, m->input_norm_embedding, hidden, m->eps, is_bf16,
                     offset, joined + r * joined_width);
            rms_norm(input_hidden + r * hidden, m->input_norm_hidden, hidden, m->eps, is_bf16,
                     offset, joined + r * joined_width + hidden);
        }
        TIMED(0, failed |= step_matmul(&m->input_fc, joined, rows, views, rest, dense_x, residual,
                             num_threads));
    }

    /* After a failed allocation no later layer runs: its K/V writes would be wrong. */
    for (int64_t l = 0; l < m->num_layers && !failed; l++) {
        const StepLayer *layer = &m->layers[l];
        const StepGroup *group = &groups[layer->group];
        const int64_t *slots = group->slots;
#pragma omp parallel for num_threads(num_threads) if (rows >= ROW_PARALLEL_MIN)
        for (int64_t r = 0; r < rows; r++)
            rms_norm(residual + r * hidden, layer->input_norm, hidden, m->eps, is_bf16, offset,
                     normed + r * hidden);
        const int64_t width = layer->qkv.n; /* this layer's first projection */
        TIMED(0, failed |= step_matmul(&layer->qkv, normed, rows, views, rest, dense_x, qkv,
                             num_threads));
        TIMED(0, failed |= lora_add(&layer->lora_qkv, normed, hidden, width, rows, row_lora,
                                    qkv, num_threads));
        const float *mixer_out = qkv; /* what the output projection reads */
        int64_t mixer_size = q_size;
        if (layer->kind == LAYER_LINEAR) {
            if (failed) break;
            TIMED(1, failed |= gated_deltanet(&layer->linear, shape, qkv, width, rows,
                                              state_reads, state_writes, m->eps, is_bf16,
                                              attended, gated, num_threads));
            mixer_out = gated;
            mixer_size = value_size;
        } else {
            const int format = m->cache_format;
            const size_t row_bytes = cache_row_bytes(format, head_dim);
            const size_t head_bytes = (size_t)(m->num_blocks * m->block_size) * row_bytes;
#pragma omp parallel for num_threads(num_threads) if (rows >= ROW_PARALLEL_MIN)
            for (int64_t r = 0; r < rows; r++) {
                float *row = qkv + r * width;
                if (layer->qkv_bias != NULL)
                    for (int64_t i = 0; i < width; i++) row[i] += dtype_value(layer->qkv_bias, i, is_bf16);
                if (layer->output_gate) { /* per head: queries, then as many gate values */
                    for (int64_t h = 0; h < m->heads; h++) {
                        memcpy(gated + r * q_size + h * head_dim, row + (2 * h + 1) * head_dim,
                               sizeof(float) * (size_t)head_dim);
                        memmove(row + h * head_dim, row + 2 * h * head_dim,
                                sizeof(float) * (size_t)head_dim);
                    }
                    memmove(row + q_size, row + 2 * q_size, sizeof(float) * (size_t)(2 * kv_size));
                }
                const float *cos = layer->rope_cos + positions[r] * m->rotary_dim;
                const float *sin = layer->rope_sin + positions[r] * m->rotary_dim;
                for (int64_t h = 0; h < m->heads + m->kv_heads; h++) {
                    float *head = row + h * head_dim;
                    const void *norm = h < m->heads ? layer->q_norm : layer->k_norm;
                    if (norm != NULL) rms_norm(head, norm, head_dim, m->eps, is_bf16, offset, head);
                    rotate(head, cos, sin, m->rotary_dim);
                }
                /* A coded cache holds K and V rotated; queries are rotated alike. */
                if (cache_rotates(format, head_dim))
                    for (int64_t h = 0; h < m->heads + 2 * m->kv_heads; h++)
                        hadamard_rotate(row + h * head_dim, head_dim);
                /* The new K and V into their cache slot, head by head. */
                for (int64_t h = 0; h < m->kv_heads; h++) {
                    const float *k = row + q_size + h * head_dim;
                    const float *v = row + q_size + kv_size + h * head_dim;
                    const size_t at = (size_t)h * head_bytes + (size_t)slots[r] * row_bytes;
                    char *k_dst = (char *)layer->key_cache + at;
                    char *v_dst = (char *)layer->value_cache + at;
                    if (cache_coded(format)) {
                        quantize_cache_row(k, head_dim, k_dst, format);
                        quantize_cache_row(v, head_dim, v_dst, format);
                        continue;
                    }
                    for (int64_t i = 0; i < head_dim; i++) {
                        store_value(k_dst, i, k[i], format == CACHE_BF16);
                        store_value(v_dst, i, v[i], format == CACHE_BF16);
                    }
                }
                /* Queries packed [rows, heads, head_dim] for the attention kernel. */
                memcpy(attended + r * q_size, row, sizeof(float) * (size_t)q_size);
            }
            /* attended holds the queries; attention reads them and writes into qkv's room. */
            float *context = qkv;
            TIMED(1, attention(m, layer, attended, rows, group, context, num_threads, &failed));
            if (cache_rotates(format, head_dim)) { /* the attended values back from the rotation */
#pragma omp parallel for num_threads(num_threads) if (rows >= ROW_PARALLEL_MIN)
                for (int64_t r = 0; r < rows; r++)
                    for (int64_t h = 0; h < m->heads; h++)
                        hadamard_rotate(context + (r * m->heads + h) * head_dim, head_dim);
            }
            if (layer->output_gate) {
#pragma omp parallel for num_threads(num_threads) if (rows >= ROW_PARALLEL_MIN)
                for (int64_t r = 0; r < rows; r++)
                    for (int64_t i = 0; i < q_size; i++)
                        context[r * q_size + i] *= sigmoid1(gated[r * q_size + i]);
            }
        }
        TIMED(0, failed |= step_matmul(&layer->o, mixer_out, rows, views, rest, dense_x, normed,
                             num_threads));
        TIMED(0, failed |= lora_add(&layer->lora_o, mixer_out, mixer_size, hidden, rows,
                                    row_lora, normed, num_threads));
#pragma omp parallel for num_threads(num_threads) if (rows >= ROW_PARALLEL_MIN)
        for (int64_t r = 0; r < rows; r++) {
            float *out = normed + r * hidden;
            if (layer->o_bias != NULL)
                for (int64_t i = 0; i < hidden; i++) out[i] += dtype_value(layer->o_bias, i, is_bf16);
            if (layer->attn_out_norm != NULL)
                rms_norm(out, layer->attn_out_norm, hidden, m->eps, is_bf16, offset, out);
            for (int64_t i = 0; i < hidden; i++) residual[r * hidden + i] += out[i];
            rms_norm(residual + r * hidden, layer->post_norm, hidden, m->eps, is_bf16, offset,
                     out);
        }
        TIMED(0, failed |= step_matmul(&layer->gate_up, normed, rows, views, rest, dense_x, gate_up,
                             num_threads));
        TIMED(0, failed |= lora_add(&layer->lora_gate_up, normed, hidden, 2 * inter, rows,
                                    row_lora, gate_up, num_threads));
#pragma omp parallel for num_threads(num_threads) if (rows >= ROW_PARALLEL_MIN)
        for (int64_t r = 0; r < rows; r++) {
            const float *g = gate_up + r * 2 * inter;
            if (m->gelu)
                gelu_tanh_mul(g, g + inter, inter, activated + r * inter);
            else
                silu_mul(g, g + inter, inter, activated + r * inter);
        }
        TIMED(0, failed |= step_matmul(&layer->down, activated, rows, views, rest, dense_x, normed,
                             num_threads));
        TIMED(0, failed |= lora_add(&layer->lora_down, activated, inter, hidden, rows,
                                    row_lora, normed, num_threads));
#pragma omp parallel for num_threads(num_threads) if (rows >= ROW_PARALLEL_MIN)
        for (int64_t r = 0; r < rows; r++) {
            float *out = normed + r * hidden;
            if (layer->mlp_out_norm != NULL)
                rms_norm(out, layer->mlp_out_norm, hidden, m->eps, is_bf16, offset, out);
            for (int64_t i = 0; i < hidden; i++) residual[r * hidden + i] += out[i];
        }
    }
    /* Only the rows asked for reach the head (a prompt chunk samples at most its last). */
    const int all_rows = hidden_out != NULL;
#pragma omp parallel for num_threads(num_threads) if (rows >= ROW_PARALLEL_MIN)
    for (int64_t i = 0; i < (all_rows ? rows : num_logits); i++) {
        const int64_t r = all_rows ? i : logit_rows[i];
        rms_norm(residual + r * hidden, m->final_norm, hidden, m->eps, is_bf16, offset,
                 (all_rows ? hidden_out : normed) + i * hidden);
    }
    const float *head_in = normed;
    if (all_rows) {
        for (int64_t i = 0; i < num_logits; i++)
            memcpy(normed + i * hidden, hidden_out + logit_rows[i] * hidden,
                   sizeof(float) * (size_t)hidden);
    }
    if (num_logits > 0)
        TIMED(0, failed |= step_matmul(&m->head, head_in, num_logits, views, rest, dense_x, logits,
                             num_threads));
    if (timings != NULL) {
        const double timed = timings[0] + timings[1] - timed_before;
        timings[2] += omp_get_wtime() - step_started - timed;
    }
    free(residual);
    free(views);
    free(scratch);
    free(dense_x);
    return failed;
}

/* Rows a step computes at a time: every layer of one chunk before the next, so the chunk's
 * activations stay in cache between operations (a 2048-token prefill spent a quarter of its
 * time moving fp32 activations through memory in one piece: 1.32x faster in chunks of 256).
 * A sequence's rows run in order, so a chunk's attention reads the K/V that earlier chunks
 * wrote; no row's result depends on the chunking. */
#define STEP_CHUNK_ROWS 256

/* One token per row: a decode row, a row verifying a draft, or one token of a prompt
 * chunk (a chunk's rows share its blocks, each row's bias masking the positions after its
 * own). Per KV group: blocks [rows, table_width] and bias [rows, table_width * block_size] as
 * decode_attention.c reads them, and slots: each row's cache slot for its new K/V; timings:
 * NULL, or three sums (see TIMED); row_lora: NULL, or each row's LoRA slot (-1: none).
 * Writes logits [num_logits, vocab] float32 of rows logit_rows[0..num_logits - 1]
 * (ascending), and where `hidden_out` is given every row's final normed hidden state
 * [rows, hidden] float32. A row's results never depend on the other rows: every operation
 * computes a row alone, or (the matmuls, attention) in one fixed order per row whoever
 * shares its tiles. A hybrid model's linear layers read each row's state_reads and
 * state_writes (gated_deltanet.h; NULL for a model without them). Returns 0, 1 when
 * scratch memory ran out, 2 for dense weights in a build without a dense kernel, 3 for a first
 * row that carries on a row before the step (or a hybrid's rows without state slots), 4
 * for an MTP layer's step without `input_hidden` (each row's [hidden] input state). */
int forklift_decode_step(const StepModel *m, int64_t rows, const int64_t *ids,
                         const int64_t *positions, const StepGroup *groups, float *logits,
                         int num_threads, double *timings, const int64_t *row_lora,
                         const int64_t *logit_rows, int64_t num_logits, float *hidden_out,
                         const int64_t *state_reads, const int64_t *state_writes,
                         const float *input_hidden) {
    if (m->input_fc.k > 0 && (input_hidden == NULL || m->input_fc.k != 2 * m->hidden ||
                              m->input_fc.n != m->hidden))
        return 4;
    int64_t num_groups = 1;
    for (int64_t l = 0; l < m->num_layers; l++)
        if (m->layers[l].group + 1 > num_groups) num_groups = m->layers[l].group + 1;
    int64_t *reads = NULL, *writes = NULL;
    if (m->linear.value_heads > 0 && state_reads == NULL) return 3;
    if (state_reads != NULL) {
        if (state_reads[0] < 0) return 3;
        reads = malloc(sizeof(int64_t) * (size_t)(2 * rows));
        if (reads == NULL) return 1;
        writes = reads + rows;
        memcpy(reads, state_reads, sizeof(int64_t) * (size_t)rows);
        memcpy(writes, state_writes, sizeof(int64_t) * (size_t)rows);
        /* A chain cut by a chunk boundary: the row before it stores the state in the slot
         * its chain ends in, and the chunk's first row starts from there. */
        for (int64_t first = STEP_CHUNK_ROWS; first < rows; first += STEP_CHUNK_ROWS) {
            if (reads[first] >= 0) continue;
            int64_t end = first; /* the chain's next row that stores its state */
            while (end < rows && writes[end] < 0 && (end == first || reads[end] < 0)) end++;
            const int stored = end < rows && (end == first || reads[end] < 0);
            if (writes[first - 1] < 0) writes[first - 1] = stored ? writes[end] : -1;
            reads[first] = writes[first - 1];
            if (reads[first] < 0) {
                free(reads);
                return 3;
            }
        }
    }
    int failed = 0;
    int64_t done_logits = 0;
    for (int64_t first = 0; first < rows; first += STEP_CHUNK_ROWS) {
        const int64_t count = rows - first < STEP_CHUNK_ROWS ? rows - first : STEP_CHUNK_ROWS;
        StepGroup chunk_groups[num_groups];
        for (int64_t g = 0; g < num_groups; g++) {
            const StepGroup *group = &groups[g];
            const int64_t width = group->table_width * m->block_size;
            chunk_groups[g] = (StepGroup){group->slots + first,
                                          group->blocks + first * group->table_width,
                                          group->table_width, group->bias + first * width};
        }
        /* This chunk's logit rows, made relative to it. */
        int64_t chunk_logits = 0;
        while (done_logits + chunk_logits < num_logits &&
               logit_rows[done_logits + chunk_logits] < first + count)
            chunk_logits++;
        int64_t local_rows[chunk_logits > 0 ? chunk_logits : 1];
        for (int64_t i = 0; i < chunk_logits; i++)
            local_rows[i] = logit_rows[done_logits + i] - first;
        failed = step_rows(m, count, ids + first, positions + first, chunk_groups,
                           logits + done_logits * m->vocab, num_threads, timings,
                           row_lora == NULL ? NULL : row_lora + first, local_rows, chunk_logits,
                           hidden_out == NULL ? NULL : hidden_out + first * m->hidden,
                           reads == NULL ? NULL : reads + first,
                           writes == NULL ? NULL : writes + first,
                           input_hidden == NULL ? NULL : input_hidden + first * m->hidden);
        if (failed) break;
        done_logits += chunk_logits;
    }
    free(reads);
    return failed;
}

/* A Gated DeltaNet layer between its projections alone, on a projection's rows (tests
 * hold it to the PyTorch layer in fp32). Returns 0, 1 when scratch memory ran out, 3 for
 * a first row that carries on a row before it. */
int forklift_linear_mixer(const LinearLayer *layer, const LinearShape *shape,
                          const float *projection, int64_t stride, int64_t rows,
                          const int64_t *reads, const int64_t *writes, float eps, int is_bf16,
                          float *out, int num_threads) {
    const int64_t channels = linear_channels(shape);
    if (rows < 1 || reads[0] < 0) return 3;
    float *conv = malloc(sizeof(float) * (size_t)(rows * channels));
    if (conv == NULL) return 1;
    const int failed = gated_deltanet(layer, shape, projection, stride, rows, reads, writes,
                                      eps, is_bf16, conv, out, num_threads);
    free(conv);
    return failed;
}
