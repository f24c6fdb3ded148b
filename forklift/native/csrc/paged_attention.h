/* Decode attention (one query per sequence) straight from the paged KV cache.
 *
 * One task per (rows of one sequence, KV head): the rows' G = H / Hkv query heads each share
 * every key and value row the task loads (a decode row alone, or the rows verifying a
 * sequence's drafts together), each row is widened to fp32 once, scores and sums stay in
 * fp32, and masked positions (bias -inf: padding, outside a sliding window, past a row's
 * own position) count nothing; positions no row attends to are never loaded. Tasks
 * run on OpenMP threads; the library is linked against the OpenMP runtime torch already
 * loaded, so both share one thread pool.
 *
 * Shapes (row-major, contiguous): q [S, H, D]; key/value cache [Hkv, NB, BS, D];
 * blocks [S, nb] int64 block ids; bias [S, nb * BS] float32; out [S, H, D]. Scores, maxima
 * and sums are per query vector in the same order whoever shares its task, so a row's
 * result never depends on the rows beside it (speculation's lossless greedy rests on it).
 */
#ifndef FORKLIFT_PAGED_ATTENTION_H
#define FORKLIFT_PAGED_ATTENTION_H

#include "common.h"
#include "fast_math.h"

/* Rows are fetched this many positions ahead: blocks lie anywhere in the cache, so the
 * hardware prefetcher loses the stream at every block boundary. */
#define PREFETCH_AHEAD 48

static inline void prefetch_row(const char *head, int64_t slot, size_t row_bytes) {
    const char *start = head + (size_t)slot * row_bytes;
    for (size_t offset = 0; offset < row_bytes; offset += 64) __builtin_prefetch(start + offset);
}

/* A cache row into L2 only (prefetch_row brings it to L1): the value rows, fetched while
 * the keys are scored (here and in the tiled form). The value pass had found its rows in
 * memory and stalled on them (a fifth of an AVX2 decode step's attention samples); the
 * scoring's arithmetic now hides their latency (batch 8 at 564 tokens: attention 1.3x
 * faster). A task's value rows (74 KB at 580 positions of 64 bf16) fit in a core's L2. */
static inline void prefetch_row_l2(const char *head, int64_t slot, size_t row_bytes) {
    const char *start = head + (size_t)slot * row_bytes;
    for (size_t offset = 0; offset < row_bytes; offset += 64)
        __builtin_prefetch(start + offset, 0, 2);
}

/* Sixteen bf16 values widened to fp32 (a zero-extend and a shift, no trip through memory). */
static inline float16_vector widen_bf16(const uint16_t *src) {
    uint16_16_vector raw;
    memcpy(&raw, src, sizeof raw);
    const int16_vector bits = __builtin_convertvector(raw, int16_vector) << 16;
    return (float16_vector)bits;
}

/* exp_nonpositive on LANES lanes at once, lanes holding -inf giving exactly 0: the same
 * polynomial, with n rounded to nearest (even) instead of floor(x log2 e + 1/2), which
 * keeps |r| <= ln2 / 2. */
static inline lane_vector exp_nonpositive_lanes(lane_vector x) {
    const lane_int_vector finite = x != -INFINITY;
    const lane_int_vector clamp = x < -87.0f; /* C has no vector ?:, so select by bits */
    const lane_vector low = {0};
    x = (lane_vector)(((lane_int_vector)(low - 87.0f) & clamp) | ((lane_int_vector)x & ~clamp));
    const float magic = 12582912.0f;
    const lane_vector n = (x * 1.44269504f + magic) - magic;
    const lane_vector r = x - n * 0.693145752f - n * 1.42860677e-6f;
    lane_vector p = r * 1.98756912e-4f + 1.39819994e-3f;
    p = p * r + 8.33345205e-3f;
    p = p * r + 4.16657962e-2f;
    p = p * r + 1.66666657e-1f;
    p = p * r + 5.0e-1f;
    p = p * r * r + r + 1.0f;
    const lane_int_vector scale = (__builtin_convertvector(n, lane_int_vector) + 127) << 23;
    return (lane_vector)((lane_int_vector)(p * (lane_vector)scale) & finite);
}

/* How the KV cache holds one row of head_dim values: fp32, bf16, or one-byte codes (int8,
 * fp8 e4m3 or e5m2) followed by their fp32 scale (value = code * scale, one scale per token
 * and KV head: the row's largest magnitude over the code's largest), head_dim + 4 bytes. */
enum { CACHE_FP32 = 0, CACHE_BF16 = 1, CACHE_INT8 = 2, CACHE_FP8_E4M3 = 3, CACHE_FP8_E5M2 = 4 };

/* A row of one-byte codes and a scale. */
static inline int cache_coded(int format) { return format >= CACHE_INT8; }

static inline size_t cache_row_bytes(int format, int64_t head_dim) {
    return cache_coded(format) ? (size_t)head_dim + sizeof(float)
                               : (size_t)head_dim * (format == CACHE_BF16 ? 2 : 4);
}

/* What a coded row's widened codes (widen_codes) are multiplied by: its scale (the row is
 * not 4-byte aligned at every head size), times 2^8 for e4m3, whose codes widen as fp16
 * bits worth 2^-8 of their value. */
static inline float coded_row_scale(int format, const char *row, int64_t head_dim) {
    float scale;
    memcpy(&scale, row + head_dim, sizeof scale);
    return format == CACHE_FP8_E4M3 ? scale * 256.0f : scale;
}

/* A coded cache stores rows of a power-of-two size rotated (model/kv_cache_dtype.py): the
 * normalised Hadamard transform spreads a few large channels over all of them, so the one
 * scale of a row loses less. Queries are rotated alike and the attended rows rotated back
 * (the transform is orthonormal and its own inverse). */
static inline int cache_rotates(int format, int64_t head_dim) {
    return cache_coded(format) && head_dim >= 2 && (head_dim & (head_dim - 1)) == 0;
}

/* An fp8 code's bits as fp16 bits: e5m2 is fp16's upper byte; e4m3's exponent and mantissa
 * shift into fp16's, its value then 2^8 times the fp16's (subnormals alike). */
static inline uint16_t fp8_as_half(uint8_t code, int format) {
    if (format == CACHE_FP8_E5M2) return (uint16_t)(code << 8);
    return (uint16_t)(((code & 0x80u) << 8) | ((code & 0x7fu) << 7));
}

/* One value widened as widen_codes does (before coded_row_scale). */
static inline float code_value(const char *codes, int64_t i, int format) {
    if (format == CACHE_INT8) return (float)((const int8_t *)codes)[i];
    return fp16_to_float(fp8_as_half(((const uint8_t *)codes)[i], format));
}

/* v (|v| <= the format's largest) as an fp8 code, rounded to nearest, ties to even, as
 * torch's conversion rounds it. */
static inline uint8_t fp8_encode(float v, int format) {
    const int mantissa_bits = format == CACHE_FP8_E4M3 ? 3 : 2;
    const int bias = format == CACHE_FP8_E4M3 ? 7 : 15;
    const int largest = format == CACHE_FP8_E4M3 ? 0x7e : 0x7b; /* 448, 57344 */
    const uint8_t sign = v < 0.0f ? 0x80 : 0;
    const float a = fabsf(v);
    if (!(a > 0.0f)) return sign;
    int exponent;
    frexpf(a, &exponent);
    exponent -= 1; /* a = 1.m x 2^exponent */
    int code;
    if (exponent < 1 - bias) { /* subnormal: steps of 2^(1 - bias - mantissa_bits) */
        code = (int)nearbyintf(ldexpf(a, bias - 1 + mantissa_bits));
    } else {
        int mantissa = (int)nearbyintf(ldexpf(a, mantissa_bits - exponent)) - (1 << mantissa_bits);
        if (mantissa == 1 << mantissa_bits) {
            exponent++;
            mantissa = 0;
        }
        code = ((exponent + bias) << mantissa_bits) | mantissa;
    }
    return sign | (uint8_t)(code > largest ? largest : code);
}

/* One butterfly level inside a vector: lane l pairs with lane l ^ span; the lower lane
 * keeps a + b, the upper a - b (partner + sign * own: the same sums as one by one). */
static inline lane_vector lane_butterfly(lane_vector v, lane_vector partner, int span) {
    lane_vector sign;
    for (int l = 0; l < LANES; l++) sign[l] = l & span ? -1.0f : 1.0f;
    return partner + sign * v;
}

/* x <- x H / sqrt(n) in place (Sylvester's H: butterflies at distances 1, 2, 4, ...): the
 * distances inside a vector by lane shuffles, the longer ones vector by vector (a row
 * rotated one value at a time cost a tenth of a 2,048-token prefill). */
static inline void hadamard_rotate(float *x, int64_t n) {
    int64_t span = 1;
    if (n % LANES == 0) {
        for (int64_t i = 0; i < n; i += LANES) {
            lane_vector v;
            memcpy(&v, x + i, sizeof v);
#if LANES == 16
            v = lane_butterfly(v, LANE_SHUFFLE(v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14), 1);
            v = lane_butterfly(v, LANE_SHUFFLE(v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13), 2);
            v = lane_butterfly(v, LANE_SHUFFLE(v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11), 4);
            v = lane_butterfly(v, LANE_SHUFFLE(v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7), 8);
#else
            v = lane_butterfly(v, LANE_SHUFFLE(v, 1, 0, 3, 2, 5, 4, 7, 6), 1);
            v = lane_butterfly(v, LANE_SHUFFLE(v, 2, 3, 0, 1, 6, 7, 4, 5), 2);
            v = lane_butterfly(v, LANE_SHUFFLE(v, 4, 5, 6, 7, 0, 1, 2, 3), 4);
#endif
            memcpy(x + i, &v, sizeof v);
        }
        for (span = LANES; span < n; span *= 2)
            for (int64_t i = 0; i < n; i += 2 * span)
                for (int64_t j = i; j < i + span; j += LANES) {
                    lane_vector a, b;
                    memcpy(&a, x + j, sizeof a);
                    memcpy(&b, x + j + span, sizeof b);
                    const lane_vector sum = a + b, difference = a - b;
                    memcpy(x + j, &sum, sizeof sum);
                    memcpy(x + j + span, &difference, sizeof difference);
                }
    }
    for (; span < n; span *= 2) /* rows of fewer values than a vector */
        for (int64_t i = 0; i < n; i += 2 * span)
            for (int64_t j = i; j < i + span; j++) {
                const float a = x[j], b = x[j + span];
                x[j] = a + b;
                x[j + span] = a - b;
            }
    const float norm = 1.0f / sqrtf((float)n);
    for (int64_t i = 0; i < n; i++) x[i] *= norm;
}

/* One row of n values into a coded form: codes of x * top / max|x|, top the codes' largest
 * magnitude (127; 448 or 57344 for fp8), then the scale max|x| / top. A row depends on its
 * own values only. int8 codes are rounded to nearest, ties to even: whole vectors where n
 * allows (rounded by the 1.5 * 2^23 trick: nearbyintf's result for these
 * magnitudes), one value at a time otherwise. Not contracted: x * inverse is rounded to
 * fp32 before it is rounded to an integer, as model/kv_cache_dtype.py rounds it. */
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("fp-contract=off")))
#endif
static inline void quantize_cache_row(const float *x, int64_t n, char *dst, int format) {
    float largest = 0.0f;
    const int vectors = n % LANES == 0;
    if (vectors) {
        lane_int_vector most = {0}; /* magnitudes' bits: ordered as the floats are */
        for (int64_t i = 0; i < n; i += LANES) {
            lane_int_vector bits;
            memcpy(&bits, x + i, sizeof bits);
            bits &= 0x7fffffff;
            const lane_int_vector higher = bits > most;
            most = (bits & higher) | (most & ~higher);
        }
        for (int l = 0; l < LANES; l++) largest = fmaxf(largest, ((lane_vector)most)[l]);
    } else {
        for (int64_t i = 0; i < n; i++) largest = fmaxf(largest, fabsf(x[i]));
    }
    const float top = format == CACHE_INT8 ? 127.0f : format == CACHE_FP8_E4M3 ? 448.0f : 57344.0f;
    const float scale = largest / top, inverse = largest > 0.0f ? top / largest : 0.0f;
    int8_t *codes = (int8_t *)dst;
    if (format != CACHE_INT8) {
        for (int64_t i = 0; i < n; i++) {
            const float scaled = x[i] * inverse;
            ((uint8_t *)dst)[i] = fp8_encode(scaled, format);
        }
    } else if (vectors) {
        const float magic = 12582912.0f;
        for (int64_t i = 0; i < n; i += LANES) {
            lane_vector v;
            memcpy(&v, x + i, sizeof v);
            const lane_vector scaled = v * inverse; /* its own statement: clang fuses within one */
            const lane_int_vector rounded =
                __builtin_convertvector((scaled + magic) - magic, lane_int_vector);
            for (int l = 0; l < LANES; l++) codes[i + l] = (int8_t)rounded[l];
        }
    } else {
        for (int64_t i = 0; i < n; i++) codes[i] = (int8_t)nearbyintf(x[i] * inverse);
    }
    memcpy(dst + n, &scale, sizeof scale);
}

/* Sixteen codes of a coded row widened to fp32 (to be multiplied by coded_row_scale): the
 * instruction set's int8 widening (isa/), and its fp8 one where it has one (F16C's vector
 * conversion from fp16 bits), else code by code. */
static inline float16_vector widen_codes(const char *src, int format) {
    if (format == CACHE_INT8) return widen_int8((const int8_t *)src);
#if defined(FORKLIFT_HAS_WIDEN_FP8)
    return widen_fp8((const uint8_t *)src, format == CACHE_FP8_E5M2);
#else
    float16_vector out;
    for (int l = 0; l < 16; l++) out[l] = code_value(src, l, format);
    return out;
#endif
}

/* The dot product of two rows of n floats, eight lanes at a time in two accumulators
 * (vectors of a width every x86-64-v3 CPU holds in one register: GCC lowers wider generic
 * vectors through memory there: a dot product measured 5x slower on AVX2). */
static inline float vector_dot(const float *a, const float *b, int64_t n) {
    float8_vector even = {0}, odd = {0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        float8_vector a0, a1, b0, b1;
        memcpy(&a0, a + i, sizeof a0);
        memcpy(&a1, a + i + 8, sizeof a1);
        memcpy(&b0, b + i, sizeof b0);
        memcpy(&b1, b + i + 8, sizeof b1);
        even += a0 * b0;
        odd += a1 * b1;
    }
    const float8_vector sum = even + odd;
    float total =
        ((sum[0] + sum[4]) + (sum[1] + sum[5])) + ((sum[2] + sum[6]) + (sum[3] + sum[7]));
    for (; i < n; i++) total += a[i] * b[i];
    return total;
}

/* Lane indices of an 8-lane shuffle (GCC's form takes them as a vector). */
typedef int32_t lane_index8 __attribute__((vector_size(32)));
#if defined(__clang__)
#define SHUFFLE8(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE8(a, b, ...) __builtin_shuffle(a, b, (lane_index8){__VA_ARGS__})
#endif

/* vector_dot of one row `a` against four rows of `keys` (n a multiple of 16), into
 * score[0..3]: the same products and sums in the same order, each vector_dot's eight lanes
 * then summed for all four rows at once by three levels of shuffles and adds instead of
 * seven scalar adds each (they were a third of an AVX2 prefill's scoring). */
static inline void vector_dot4(const float *a, const float *keys, int64_t n, float *score) {
    float8_vector even[4] = {{0}}, odd[4] = {{0}};
    for (int64_t i = 0; i + 16 <= n; i += 16) {
        float8_vector a0, a1;
        memcpy(&a0, a + i, sizeof a0);
        memcpy(&a1, a + i + 8, sizeof a1);
        for (int p = 0; p < 4; p++) {
            float8_vector b0, b1;
            memcpy(&b0, keys + p * n + i, sizeof b0);
            memcpy(&b1, keys + p * n + i + 8, sizeof b1);
            even[p] += a0 * b0;
            odd[p] += a1 * b1;
        }
    }
    const float8_vector s0 = even[0] + odd[0], s1 = even[1] + odd[1];
    const float8_vector s2 = even[2] + odd[2], s3 = even[3] + odd[3];
    /* lanes i of rows p, p + 1: sum[i] + sum[i + 4] */
    const float8_vector u01 = SHUFFLE8(s0, s1, 0, 1, 2, 3, 8, 9, 10, 11) +
                              SHUFFLE8(s0, s1, 4, 5, 6, 7, 12, 13, 14, 15);
    const float8_vector u23 = SHUFFLE8(s2, s3, 0, 1, 2, 3, 8, 9, 10, 11) +
                              SHUFFLE8(s2, s3, 4, 5, 6, 7, 12, 13, 14, 15);
    /* each row's (lane 0 + lane 1), (lane 2 + lane 3) of the above */
    const float8_vector v = SHUFFLE8(u01, u23, 0, 2, 4, 6, 8, 10, 12, 14) +
                            SHUFFLE8(u01, u23, 1, 3, 5, 7, 9, 11, 13, 15);
    const float8_vector total = v + SHUFFLE8(v, v, 1, 0, 3, 2, 5, 4, 7, 6);
    for (int p = 0; p < 4; p++) score[p] = total[2 * p];
}

/* An eight-float vector kept in a register from here on: GCC folds each use of a loaded
 * vector into a load of its own, and the loops below are bound by loads. Nothing where
 * such vectors have no register of their own. */
#if defined(FORKLIFT_ISA_AVX2)
#define HOLD_IN_REGISTER(v) __asm__("" : "+x"(v))
#else
#define HOLD_IN_REGISTER(v) ((void)0)
#endif

/* Query vectors from which an eight-lane task scores sixteen positions at a time against
 * keys laid out dimension-major (score_transposed) and widens its value rows once
 * (accumulate_widened_values): both cost a fixed amount per position, which a few vectors
 * (a decode row's G) would not earn back, and both give the bits of the paths below it. */
#define TRANSPOSED_KEYS_MIN_QUERIES 16

/* Eight rows of n floats (n a multiple of 8), row p at rows + p * n, transposed into
 * out[d * 8 + p]: eight by eight through two levels of in-lane shuffles and one of
 * half swaps. */
static inline void transpose_eight_rows(const float *rows, int64_t n, float *out) {
    for (int64_t d = 0; d < n; d += 8) {
        float8_vector r[8];
        for (int p = 0; p < 8; p++) memcpy(&r[p], rows + p * n + d, sizeof r[p]);
        float8_vector t[8], u[8];
        for (int p = 0; p < 8; p += 2) {
            t[p] = SHUFFLE8(r[p], r[p + 1], 0, 8, 1, 9, 4, 12, 5, 13);
            t[p + 1] = SHUFFLE8(r[p], r[p + 1], 2, 10, 3, 11, 6, 14, 7, 15);
        }
        for (int p = 0; p < 8; p += 4)
            for (int h = 0; h < 2; h++) {
                u[p + h] = SHUFFLE8(t[p + h], t[p + h + 2], 0, 1, 8, 9, 4, 5, 12, 13);
                u[p + h + 2] = SHUFFLE8(t[p + h], t[p + h + 2], 2, 3, 10, 11, 6, 7, 14, 15);
            }
        /* u[0]: dims d, d+4 of rows 0-3 | u[4]: the same of rows 4-7, and so on */
        const int order[4] = {0, 2, 1, 3};
        for (int i = 0; i < 4; i++) {
            const float8_vector a = u[order[i]], b = u[order[i] + 4];
            const float8_vector low = SHUFFLE8(a, b, 0, 1, 2, 3, 8, 9, 10, 11);
            const float8_vector high = SHUFFLE8(a, b, 4, 5, 6, 7, 12, 13, 14, 15);
            memcpy(out + (d + i) * 8, &low, sizeof low);
            memcpy(out + (d + i + 4) * 8, &high, sizeof high);
        }
    }
}

/* vector_dot4's scores of two query vectors against sixteen keys at once, keys transposed
 * in two sets of eight (kt[0], kt[1]: transpose_eight_rows), a key to a lane: each score
 * takes exactly vector_dot's products and sums (lane l's even and odd chains over dims
 * 16c + l and 16c + 8 + l, fused, then ((s0 + s4) + (s1 + s5)) + ((s2 + s6) + (s3 + s7))),
 * so a position's score is the same bits whichever way its task scores it, and no
 * horizontal sums are left to do. Each key vector loaded serves both queries and each
 * query value broadcast both key vectors: a load per product. totals[2 q + h]: query q's
 * scores of keys 8h .. 8h + 7. */
static inline __attribute__((always_inline)) void score_sixteen_keys(
    const float *const queries[2], const float *const kt[2], int64_t head_dim,
    float8_vector totals[4]) {
    float8_vector lane_sums[8][4];
    for (int l = 0; l < 8; l++) {
        float8_vector even[4] = {{0}}, odd[4] = {{0}};
        for (int64_t c = 0; c < head_dim / 16; c++) {
            const int64_t de = 16 * c + l, dodd = de + 8;
            float8_vector ke[2], ko[2];
            for (int h = 0; h < 2; h++) {
                memcpy(&ke[h], kt[h] + de * 8, sizeof ke[h]);
                memcpy(&ko[h], kt[h] + dodd * 8, sizeof ko[h]);
                HOLD_IN_REGISTER(ke[h]);
                HOLD_IN_REGISTER(ko[h]);
            }
            for (int q = 0; q < 2; q++) {
                const float qe = queries[q][de], qo = queries[q][dodd];
                for (int h = 0; h < 2; h++) {
                    even[2 * q + h] += qe * ke[h];
                    odd[2 * q + h] += qo * ko[h];
                }
            }
        }
        for (int i = 0; i < 4; i++) lane_sums[l][i] = even[i] + odd[i];
    }
    for (int i = 0; i < 4; i++)
        totals[i] =
            ((lane_sums[0][i] + lane_sums[4][i]) + (lane_sums[1][i] + lane_sums[5][i])) +
            ((lane_sums[2][i] + lane_sums[6][i]) + (lane_sums[3][i] + lane_sums[7][i]));
}

/* The dot product of two rows of n floats, for head sizes that are not a multiple of 16. */
static inline float dot(const float *a, const float *b, int64_t n) {
    float sum = 0.0f;
    for (int64_t i = 0; i < n; i++) sum += a[i] * b[i];
    return sum;
}

/* The four sums of four 16-lane vectors at once, as lanes 0, 4, 8 and 12 of the result:
 * three shuffle-and-add levels serve four dot products (a tree per vector would take four
 * each). Every vector's lanes are added in the same order whichever slot it has, so a
 * score never depends on the positions computed beside it. */
static inline float16_vector sum4(float16_vector a0, float16_vector a1, float16_vector a2,
                                  float16_vector a3) {
    const float16_vector t0 = SHUFFLE2(a0, a1, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21,
                                       22, 23) +
                              SHUFFLE2(a0, a1, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27,
                                       28, 29, 30, 31);
    const float16_vector t1 = SHUFFLE2(a2, a3, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21,
                                       22, 23) +
                              SHUFFLE2(a2, a3, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27,
                                       28, 29, 30, 31);
    const float16_vector u = SHUFFLE2(t0, t1, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25,
                                      26, 27) +
                             SHUFFLE2(t0, t1, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28,
                                      29, 30, 31);
    const float16_vector v = u + SHUFFLE(u, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    return v + SHUFFLE(v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
}

/* acc[j] = sum_t p[j, t] * V[t] for query vectors j in [first, first + pass) (vectors past
 * `count` get zero weights), over the live positions only, with the pass's sums held in
 * registers: head_dim, pass and the cache format (bf16, or coded: a row's scale joins the
 * weight) are constants at each call site once inlined. */
static inline __attribute__((always_inline)) void accumulate_values(
    float *acc, const float *scores, const char *v_head, const int64_t *slots,
    const int64_t *live, int64_t num_live, int64_t width, int64_t first, int64_t count,
    int64_t head_dim, int64_t pass, int format) {
    float16_vector sums[4][8] = {{{0}}};
    const int64_t chunks = head_dim / 16;
    const size_t row_bytes = cache_row_bytes(format, head_dim);
    for (int64_t i = 0; i < num_live; i++) {
        const int64_t t = live[i];
        if (i + PREFETCH_AHEAD < num_live)
            prefetch_row(v_head, slots[live[i + PREFETCH_AHEAD]], row_bytes);
        const char *row = v_head + (size_t)slots[t] * row_bytes;
        float16_vector v[8];
        float row_scale = 1.0f;
        if (cache_coded(format)) {
            row_scale = coded_row_scale(format, row, head_dim);
            for (int64_t c = 0; c < chunks; c++) v[c] = widen_codes(row + c * 16, format);
        } else {
            for (int64_t c = 0; c < chunks; c++) v[c] = widen_bf16((const uint16_t *)row + c * 16);
        }
        for (int64_t h = 0; h < pass; h++) {
            const float p = first + h < count ? scores[(first + h) * width + t] * row_scale : 0.0f;
            for (int64_t c = 0; c < chunks; c++) sums[h][c] += p * v[c];
        }
    }
    for (int64_t h = 0; h < pass && first + h < count; h++)
        memcpy(acc + (first + h) * head_dim, sums[h], sizeof(float) * (size_t)head_dim);
}

/* Live positions whose value rows (64 values of each: one slice) stay in L1 while every
 * query vector of a task reads them. */
#define PLAIN_VALUE_CHUNK 64

/* Eight values of a plain cache row as fp32: a load, or bf16 zero-extended and shifted. */
static inline float8_vector load_value8(const char *row, int64_t d, int is_bf16) {
    if (is_bf16) return widen8_bf16((const uint16_t *)row + d);
    float8_vector v;
    memcpy(&v, (const float *)row + d, sizeof v);
    return v;
}

/* acc[j, :] = sum_t p[j, t] * V[t] for all `count` vectors over the live positions, V a plain
 * cache (fp32, or bf16 widened on the fly) of head_dim a multiple of 64, in 8-lane registers
 * (the 16-lane accumulate_values spills them where registers hold eight floats). Chunk by
 * chunk of live positions, eight 8-lane registers of sums stay put across the chunk: two
 * vectors' sums for a 32-value half slice (an odd count's last vector: its own for a
 * 64-value slice). Added onto their row of acc one position at a time, in position order,
 * they cost a load and a store per product and the stores bound the pass. Every sum takes
 * its products in position order, fused, as accumulate_values does: the same bits. */
static inline __attribute__((always_inline)) void accumulate_plain_values(
    float *acc, const float *scores, const char *v_head, const int64_t *slots,
    const int64_t *live, int64_t num_live, int64_t width, int64_t count, int64_t head_dim,
    int is_bf16) {
    const size_t row_bytes = (size_t)head_dim * (is_bf16 ? 2 : 4);
    memset(acc, 0, sizeof(float) * (size_t)(count * head_dim));
    for (int64_t c0 = 0; c0 < num_live; c0 += PLAIN_VALUE_CHUNK) {
        const int64_t c1 = c0 + PLAIN_VALUE_CHUNK < num_live ? c0 + PLAIN_VALUE_CHUNK : num_live;
        for (int64_t i = c1; i < c1 + PLAIN_VALUE_CHUNK && i < num_live; i++)
            prefetch_row(v_head, slots[live[i]], row_bytes);
        /* Two vectors at a time: each value vector loaded serves both (a load per product
         * when one vector took a whole slice). */
        int64_t j = 0;
        for (; j + 2 <= count; j += 2) {
            const float *pa = scores + j * width, *pb = pa + width;
            for (int64_t d0 = 0; d0 < head_dim; d0 += 32) {
                float *aa = acc + j * head_dim + d0, *ab = aa + head_dim;
                float8_vector sa[4], sb[4];
                memcpy(sa, aa, sizeof sa);
                memcpy(sb, ab, sizeof sb);
                for (int64_t i = c0; i < c1; i++) {
                    const int64_t t = live[i];
                    const char *row = v_head + (size_t)slots[t] * row_bytes;
                    const float p = pa[t], q = pb[t];
                    for (int c = 0; c < 4; c++) {
                        const float8_vector v = load_value8(row, d0 + 8 * c, is_bf16);
                        sa[c] += p * v;
                        sb[c] += q * v;
                    }
                }
                memcpy(aa, sa, sizeof sa);
                memcpy(ab, sb, sizeof sb);
            }
        }
        for (; j < count; j++) {
            const float *pj = scores + j * width;
            for (int64_t d0 = 0; d0 < head_dim; d0 += 64) {
                float *aj = acc + j * head_dim + d0;
                float8_vector sums[8];
                memcpy(sums, aj, sizeof sums);
                for (int64_t i = c0; i < c1; i++) {
                    const int64_t t = live[i];
                    const char *row = v_head + (size_t)slots[t] * row_bytes;
                    const float p = pj[t];
                    for (int c = 0; c < 8; c++) sums[c] += p * load_value8(row, d0 + 8 * c, is_bf16);
                }
                memcpy(aj, sums, sizeof sums);
            }
        }
    }
}

/* A query vector's output row: its weighted sum of values over its total weight (zeros
 * where it attends nothing), stored as fp32 or bf16. */
static inline void store_normalised(void *out_row, const float *sums, float total,
                                    int64_t head_dim, int io_bf16) {
    const float inv = total > 0.0f ? 1.0f / total : 0.0f;
    if (io_bf16) {
        uint16_t *dst = (uint16_t *)out_row;
        for (int64_t d = 0; d < head_dim; d++) dst[d] = float_to_bf16(sums[d] * inv);
    } else {
        float *dst = (float *)out_row;
        for (int64_t d = 0; d < head_dim; d++) dst[d] = sums[d] * inv;
    }
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

/* One cache row widened to fp32 (a coded row's codes times its scale). */
#define LOAD_CACHE_ROW(dst, src, d_count, format)                                    \
    do {                                                                             \
        if ((format) == CACHE_INT8) {                                                \
            const int8_t *codes_ = (const int8_t *)(src);                            \
            const float scale_ = coded_row_scale((format), (const char *)(src), (d_count)); \
            _Pragma("omp simd") for (int64_t d_ = 0; d_ < (d_count); d_++)           \
                (dst)[d_] = (float)codes_[d_] * scale_;                              \
        } else if (cache_coded(format)) {                                            \
            const float scale_ = coded_row_scale((format), (const char *)(src), (d_count)); \
            for (int64_t d_ = 0; d_ < (d_count); d_++)                               \
                (dst)[d_] = code_value((const char *)(src), d_, (format)) * scale_;  \
        } else {                                                                     \
            LOAD_ROW(dst, src, d_count, (format) == CACHE_BF16);                     \
        }                                                                            \
    } while (0)

/* Scores of query vectors against four key rows (fp32, [4, head_dim]) at live positions
 * `at`, into scores[j, at[p]] (scale and each vector's row bias applied), tracking maxima. */
static inline __attribute__((always_inline)) void score_four(
    const float *queries, int64_t count, const float *keys, const int64_t *at,
    const float *const *row_bias, int64_t group, float scale, int64_t head_dim,
    int64_t width, float *scores, float *max_score) {
    const int64_t chunks = head_dim / 16;
    for (int64_t j = 0; j < count; j++) {
        const float *qj = queries + j * head_dim;
        const float *b = row_bias[j / group];
        float score[4];
        if (LANES < 16 && head_dim % 16 == 0) {
            /* Without 512-bit registers the 16-lane sums below go through the stack: eight
             * lanes a register, each key's sum added in one fixed order. */
            vector_dot4(qj, keys, head_dim, score);
        } else if (head_dim % 16 == 0) {
            float16_vector a[4] = {{0}};
            for (int64_t c = 0; c < chunks; c++) {
                float16_vector q;
                memcpy(&q, qj + 16 * c, sizeof q);
                for (int p = 0; p < 4; p++) {
                    float16_vector k;
                    memcpy(&k, keys + p * head_dim + 16 * c, sizeof k);
                    a[p] += q * k;
                }
            }
            const float16_vector sums = sum4(a[0], a[1], a[2], a[3]);
            for (int p = 0; p < 4; p++) score[p] = sums[4 * p];
        } else {
            for (int p = 0; p < 4; p++) score[p] = dot(qj, keys + p * head_dim, head_dim);
        }
        for (int p = 0; p < 4; p++) {
            const float s = score[p] * scale + b[at[p]];
            scores[j * width + at[p]] = s;
            if (s > max_score[j]) max_score[j] = s;
        }
    }
}

/* accumulate_plain_values for a task of many query vectors (at least
 * TRANSPOSED_KEYS_MIN_QUERIES, head sizes a multiple of 16): each chunk of live positions'
 * value rows is widened to fp32 once into `widened` ([PLAIN_VALUE_CHUNK, D]), where every
 * vector's pass reads it from L1; widened on the fly, each row was widened again for every
 * pair of vectors. Four vectors' sums of a sixteen-value slice stay in registers across the
 * chunk, each value vector loaded serving all four. The same products, fused, in the same
 * position order: the same bits. */
static inline __attribute__((always_inline)) void accumulate_widened_values(
    float *acc, const float *scores, const char *v_head, const int64_t *slots,
    const int64_t *live, int64_t num_live, int64_t width, int64_t count, int64_t head_dim,
    int is_bf16, float *widened) {
    const size_t row_bytes = (size_t)head_dim * (is_bf16 ? 2 : 4);
    memset(acc, 0, sizeof(float) * (size_t)(count * head_dim));
    for (int64_t c0 = 0; c0 < num_live; c0 += PLAIN_VALUE_CHUNK) {
        const int64_t c1 = c0 + PLAIN_VALUE_CHUNK < num_live ? c0 + PLAIN_VALUE_CHUNK : num_live;
        for (int64_t i = c1; i < c1 + PLAIN_VALUE_CHUNK && i < num_live; i++)
            prefetch_row(v_head, slots[live[i]], row_bytes);
        for (int64_t i = c0; i < c1; i++)
            LOAD_ROW(widened + (i - c0) * head_dim, v_head + (size_t)slots[live[i]] * row_bytes,
                     head_dim, is_bf16);
        for (int64_t j = 0; j < count; j += 4) {
            const float *p[4];
            int64_t rows[4];
            for (int q = 0; q < 4; q++) {
                rows[q] = j + q < count ? j + q : count - 1; /* repeats store the same sums */
                p[q] = scores + rows[q] * width;
            }
            for (int64_t d0 = 0; d0 < head_dim; d0 += 16) {
                float8_vector sums[4][2];
                for (int q = 0; q < 4; q++)
                    memcpy(sums[q], acc + rows[q] * head_dim + d0, sizeof sums[q]);
                for (int64_t i = c0; i < c1; i++) {
                    const int64_t t = live[i];
                    float8_vector v0, v1;
                    memcpy(&v0, widened + (i - c0) * head_dim + d0, sizeof v0);
                    memcpy(&v1, widened + (i - c0) * head_dim + d0 + 8, sizeof v1);
                    HOLD_IN_REGISTER(v0); /* loaded once for the four vectors */
                    HOLD_IN_REGISTER(v1);
                    for (int q = 0; q < 4; q++) {
                        const float weight = p[q][t];
                        sums[q][0] += weight * v0;
                        sums[q][1] += weight * v1;
                    }
                }
                for (int q = 0; q < 4; q++)
                    memcpy(acc + rows[q] * head_dim + d0, sums[q], sizeof sums[q]);
            }
        }
    }
}

/* Live positions i .. i + n - 1 (a last partial run repeating the final live position):
 * their positions into at[], their key rows widened into keys[p * D], and the rows
 * PREFETCH_AHEAD positions on fetched (keys into L1, values into L2). */
static inline __attribute__((always_inline)) void gather_key_rows(
    const char *k_head, const char *v_head, const int64_t *slots, const int64_t *live,
    int64_t num_live, int64_t i, int n, size_t row_bytes, int64_t head_dim, int format,
    int64_t *at, float *keys) {
    for (int p = 0; p < n; p++) {
        at[p] = live[i + p < num_live ? i + p : num_live - 1];
        if (i + PREFETCH_AHEAD + p < num_live) {
            const int64_t ahead = slots[live[i + PREFETCH_AHEAD + p]];
            prefetch_row(k_head, ahead, row_bytes);
            prefetch_row_l2(v_head, ahead, row_bytes);
        }
        LOAD_CACHE_ROW(keys + p * head_dim, k_head + (size_t)slots[at[p]] * row_bytes,
                       head_dim, format);
    }
}

/* The scores of a task's `count` query vectors (at least TRANSPOSED_KEYS_MIN_QUERIES, head
 * sizes a multiple of 16, eight-lane builds) at its live positions, sixteen positions at a
 * time: their key rows widened into keys[0 .. 16 D) and transposed eight by eight into
 * keys[16 D .. 32 D), then two query vectors at a time score them (score_sixteen_keys:
 * score_four's bits). A query's eight scores of a set get its row's bias and are stored as
 * one vector where the positions run on (a last partial sixteen repeats its final
 * position, which writes the same score again). As score_four leaves them: scores[j, t]
 * and each vector's maximum. */
static inline __attribute__((always_inline)) void score_transposed(
    const float *queries, int64_t count, float *keys, const char *k_head, const char *v_head,
    const int64_t *slots, const int64_t *live, int64_t num_live, const float *const *row_bias,
    int64_t group, float scale, int64_t head_dim, int64_t width, size_t row_bytes, int format,
    float *scores, float *max_score) {
    const float *const kt[2] = {keys + 16 * head_dim, keys + 24 * head_dim};
    for (int64_t i = 0; i < num_live; i += 16) {
        int64_t at[16];
        gather_key_rows(k_head, v_head, slots, live, num_live, i, 16, row_bytes, head_dim,
                        format, at, keys);
        for (int h = 0; h < 2; h++)
            transpose_eight_rows(keys + 8 * h * head_dim, head_dim, (float *)kt[h]);
        int runs_on[2];
        for (int h = 0; h < 2; h++) runs_on[h] = at[8 * h + 7] - at[8 * h] == 7;
        for (int64_t j0 = 0; j0 < count; j0 += 2) {
            const float *const two[2] = {queries + j0 * head_dim,
                                         queries + (j0 + 1 < count ? j0 + 1 : j0) * head_dim};
            float8_vector totals[4];
            score_sixteen_keys(two, kt, head_dim, totals);
            for (int q = 0; q < 2 && j0 + q < count; q++) {
                const int64_t j = j0 + q;
                const float *b = row_bias[j / group];
                float *sj = scores + j * width;
                float most = max_score[j];
                for (int h = 0; h < 2; h++) {
                    const int64_t *set = at + 8 * h;
                    if (runs_on[h]) {
                        float8_vector bias;
                        memcpy(&bias, b + set[0], sizeof bias);
                        const float8_vector s = totals[2 * q + h] * scale + bias;
                        memcpy(sj + set[0], &s, sizeof s);
                        for (int p = 0; p < 8; p++) most = s[p] > most ? s[p] : most;
                    } else {
                        for (int p = 0; p < 8; p++) {
                            const float s = totals[2 * q + h][p] * scale + b[set[p]];
                            sj[set[p]] = s;
                            most = s > most ? s : most;
                        }
                    }
                }
                max_score[j] = most;
            }
        }
    }
}

/* Attention of `num_rows` consecutive rows that read the same blocks (one sequence: its
 * decode row, or the rows verifying its drafts) for one KV head. The rows' G query heads
 * each are `count = num_rows * G` query vectors sharing every key and value row loaded,
 * each row widened to fp32 once; each vector's own bias row masks its positions, so a
 * vector's result does not depend on which rows share its task. format: the cache's
 * CACHE_* form; io_bf16: q and out in bf16 (else fp32). */
static inline __attribute__((always_inline)) int attend_rows(
                      const void *q, const void *key_cache, const void *value_cache,
                      const int64_t *blocks, const float *bias, void *out, int64_t first_row,
                      int64_t num_rows, int64_t kv_head, int64_t heads, int64_t kv_heads,
                      int64_t num_blocks, int64_t block_size, int64_t head_dim,
                      int64_t table_width, float scale, int format, int io_bf16) {
    const int64_t group = heads / kv_heads, count = num_rows * group;
    const int64_t width = table_width * block_size;
    const size_t io_elem = io_bf16 ? 2 : 4;
    /* Enough vectors to score positions against transposed keys and widen values once. */
    const int many_queries =
        LANES < 16 && head_dim % 16 == 0 && count >= TRANSPOSED_KEYS_MIN_QUERIES;
    const size_t floats = (size_t)(count * width + 2 * count * head_dim +
                                   (many_queries ? PLAIN_VALUE_CHUNK : 4) * head_dim);
    float *buffer = malloc(sizeof(float) * floats);
    /* slots, live, then one flag a position: whether any row attends to it */
    int64_t *slots = malloc(sizeof(int64_t) * (size_t)(2 * width + 4) + (size_t)width);
    if (buffer == NULL || slots == NULL) {
        free(buffer);
        free(slots);
        return 1;
    }
    float *scores = buffer;                       /* [count, width] */
    float *queries = scores + count * width;      /* [count, D] */
    float *acc = queries + count * head_dim;      /* [count, D] */
    /* [4, D]; with many_queries, [16, D] and two [D, 8], then widened values
     * [PLAIN_VALUE_CHUNK, D] */
    float *keys = acc + count * head_dim;
    int64_t *live = slots + width;                /* positions any row attends to */
    const float *row_bias[num_rows];
    for (int64_t r = 0; r < num_rows; r++) row_bias[r] = bias + (first_row + r) * width;
    const int64_t *table = blocks + first_row * table_width;
    /* Each position's cache slot, computed block by block (a division per position costs
     * more than the position's arithmetic). */
    for (int64_t i = 0; i < table_width; i++)
        for (int64_t j = 0; j < block_size; j++)
            slots[i * block_size + j] = table[i] * block_size + j;
    /* Row by row along its bias (position by position across the rows, the compiler
     * gathered the rows' biases: a tenth of an AVX2 prefill's attention). */
    unsigned char *attended = (unsigned char *)(slots + 2 * width + 4);
    memset(attended, 0, (size_t)width);
    for (int64_t r = 0; r < num_rows; r++) {
        const float *b = row_bias[r];
        for (int64_t t = 0; t < width; t++) attended[t] |= b[t] != -INFINITY;
    }
    int64_t num_live = 0;
    for (int64_t t = 0; t < width; t++)
        if (attended[t]) live[num_live++] = t;
    /* Past the last live position every score is -inf (weight exactly 0) for every
     * vector: neither cleared nor exponentiated (a prompt chunk's early rows see a fraction
     * of its table). The weights' sums gain nothing but exact zeros there, lane by lane. */
    const int64_t live_end = num_live > 0 ? live[num_live - 1] + 1 : 0;
    for (int64_t j = 0; j < count; j++) {
        const int64_t row = first_row + j / group, head = kv_head * group + j % group;
        LOAD_ROW(queries + j * head_dim, (const char *)q + (size_t)((row * heads + head) *
                 head_dim) * io_elem, head_dim, io_bf16);
        for (int64_t t = 0; t < live_end; t++) scores[j * width + t] = -INFINITY;
    }

    const size_t row_bytes = cache_row_bytes(format, head_dim);
    const size_t head_bytes = (size_t)(num_blocks * block_size) * row_bytes;
    const char *k_head = (const char *)key_cache + (size_t)kv_head * head_bytes;
    const char *v_head = (const char *)value_cache + (size_t)kv_head * head_bytes;

    float max_score[count];
    for (int64_t j = 0; j < count; j++) max_score[j] = -INFINITY;
    if (many_queries) {
        score_transposed(queries, count, keys, k_head, v_head, slots, live, num_live, row_bias,
                         group, scale, head_dim, width, row_bytes, format, scores, max_score);
    } else {
        /* Four live positions at a time; a last partial four repeats its final position (the
         * repeat writes the same score again). */
        for (int64_t i = 0; i < num_live; i += 4) {
            int64_t at[4];
            gather_key_rows(k_head, v_head, slots, live, num_live, i, 4, row_bytes, head_dim,
                            format, at, keys);
            score_four(queries, count, keys, at, row_bias, group, scale, head_dim, width, scores,
                       max_score);
        }
    }

    float total[count];
    for (int64_t j = 0; j < count; j++) {
        float *sj = scores + j * width;
        const float m = max_score[j];
        lane_vector sums = {0};
        int64_t t = 0;
        for (; t + LANES <= live_end; t += LANES) {
            lane_vector x;
            memcpy(&x, sj + t, sizeof x);
            const lane_vector p = exp_nonpositive_lanes(x - m);
            memcpy(sj + t, &p, sizeof p);
            sums += p;
        }
        if (t < live_end) {
            /* The last partial vector padded with -inf (weight exactly 0): every position is
             * weighed and summed in its lane t mod LANES as in a wider table, so a row's sum
             * does not depend on how far the tables of the rows beside it reach. */
            lane_vector x = {0};
            x -= INFINITY;
            memcpy(&x, sj + t, sizeof(float) * (size_t)(live_end - t));
            const lane_vector p = exp_nonpositive_lanes(x - m);
            memcpy(sj + t, &p, sizeof(float) * (size_t)(live_end - t));
            sums += p;
        }
        float sum = 0.0f;
        for (int l = 0; l < LANES; l++) sum += sums[l];
        total[j] = sum;
    }

    if (many_queries && (format == CACHE_FP32 || format == CACHE_BF16)) {
        accumulate_widened_values(acc, scores, v_head, slots, live, num_live, width, count,
                                  head_dim, format == CACHE_BF16, keys);
    } else if ((format == CACHE_FP32 || (format == CACHE_BF16 && LANES < 16)) &&
               head_dim % 64 == 0) {
        accumulate_plain_values(acc, scores, v_head, slots, live, num_live, width, count,
                                head_dim, format == CACHE_BF16);
    } else if (format != CACHE_FP32 && (head_dim == 64 || head_dim == 128)) {
        /* Each pass writes its vectors' sums whole: acc needs no clearing. */
        const int64_t per_pass = 256 / head_dim; /* 16 accumulator vectors a pass */
        for (int64_t j = 0; j < count; j += per_pass) {
            if (format == CACHE_INT8)
                accumulate_values(acc, scores, v_head, slots, live, num_live, width, j, count,
                                  head_dim, per_pass, CACHE_INT8);
            else if (format == CACHE_FP8_E4M3)
                accumulate_values(acc, scores, v_head, slots, live, num_live, width, j, count,
                                  head_dim, per_pass, CACHE_FP8_E4M3);
            else if (format == CACHE_FP8_E5M2)
                accumulate_values(acc, scores, v_head, slots, live, num_live, width, j, count,
                                  head_dim, per_pass, CACHE_FP8_E5M2);
            else
                accumulate_values(acc, scores, v_head, slots, live, num_live, width, j, count,
                                  head_dim, per_pass, CACHE_BF16);
        }
    } else {
        float *row = keys;
        memset(acc, 0, sizeof(float) * (size_t)(count * head_dim));
        for (int64_t i = 0; i < num_live; i++) {
            const int64_t t = live[i];
            if (i + PREFETCH_AHEAD < num_live)
                prefetch_row(v_head, slots[live[i + PREFETCH_AHEAD]], row_bytes);
            LOAD_CACHE_ROW(row, v_head + (size_t)slots[t] * row_bytes, head_dim, format);
            for (int64_t j = 0; j < count; j++) {
                const float p = scores[j * width + t];
                float *aj = acc + j * head_dim;
                _Pragma("omp simd") for (int64_t d = 0; d < head_dim; d++) aj[d] += p * row[d];
            }
        }
    }

    for (int64_t j = 0; j < count; j++) {
        const int64_t row = first_row + j / group, head = kv_head * group + j % group;
        char *out_row = (char *)out + (size_t)((row * heads + head) * head_dim) * io_elem;
        store_normalised(out_row, acc + j * head_dim, total[j], head_dim, io_bf16);
    }
    free(buffer);
    free(slots);
    return 0;
}

/* One row (sequence) alone: the decode kernel behind the PyTorch layers. */
static inline __attribute__((always_inline)) int attend_one(
                      const void *q, const void *key_cache, const void *value_cache,
                      const int64_t *blocks, const float *bias, void *out, int64_t seq,
                      int64_t kv_head, int64_t heads, int64_t kv_heads, int64_t num_blocks,
                      int64_t block_size, int64_t head_dim, int64_t table_width, float scale,
                      int format, int io_bf16) {
    return attend_rows(q, key_cache, value_cache, blocks, bias, out, seq, 1, kv_head, heads,
                       kv_heads, num_blocks, block_size, head_dim, table_width, scale, format,
                       io_bf16);
}

/* The tiled form where this build has it (isa/isa.h's ATTENTION_TILES): tiles_cover says
 * which caches it serves. */
#if defined(ATTENTION_TILES)
#include "paged_attention_avx512.h"
#endif

#endif
