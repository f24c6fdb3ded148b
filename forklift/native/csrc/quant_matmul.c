/* The quantized matmul of quant_matmul.h as one exported call: x [rows, K] (fp32 or bf16)
 * times the weight's blocks, out [rows, N] in x's dtype. */
#include "quant_matmul.h"

/* 1 where matmuls of 16 rows or more multiply on AMX tiles in this build and process. */
int forklift_quant_tiles_available(void) {
#if defined(FORKLIFT_QUANT_TILES)
    return amx_tiles_usable();
#else
    return 0;
#endif
}

/* Which precise weights take each activation row as one wide row of codes
 * (quantize_wide_row: twelve bits for a q4 weight, sixteen for a q8 one) rather than as two
 * int8 rows: bit 0 q4 weights, bit 1 q8 weights. */
int forklift_quant_wide_precise(void) {
#if defined(FORKLIFT_PAIRED_GROUPS)
    return 3;
#elif defined(FORKLIFT_WIDE_Q8_DOTS)
    return 2;
#else
    return 0;
#endif
}

/* Returns 0 on success, 1 when scratch memory could not be allocated. */
int forklift_quant_matmul(const void *x, int64_t rows, int64_t k, const void *codes,
                          const uint16_t *d, const uint16_t *m, int64_t n, int precise,
                          void *out, int is_bf16, int num_threads) {
    /* bf16 rows are widened into (and the result built in) rows * max(k, n) floats; fp32
     * rows are read and written in place. Either way k more floats for precise residuals. */
    const int64_t widened = is_bf16 ? rows * (k > n ? k : n) : 0;
    QuantizedRow *views = malloc(sizeof(QuantizedRow) * (size_t)(2 * rows));
    float *wide = malloc(sizeof(float) * (size_t)(widened + k));
    int8_t *scratch = views == NULL ? NULL : quantized_rows_alloc(2 * rows, k, views);
    if (views == NULL || wide == NULL || scratch == NULL) {
        free(views);
        free(wide);
        free(scratch);
        return 1;
    }
    float *rest = wide + widened;
    if (is_bf16) {
        const uint16_t *src = x;
        for (int64_t i = 0; i < rows * k; i++) wide[i] = bf16_to_float(src[i]);
    }
    const float *rows_in = is_bf16 ? wide : (const float *)x;
    const QuantWeight weight = {codes, d, m, n, k, precise, 0};
    /* bf16: the float result reuses `wide` (the rows are quantized before any is written). */
    float *result = is_bf16 ? wide : (float *)out;
    const int failed = quant_matmul_rows(&weight, rows_in, rows, views, rest, result, num_threads);
    if (is_bf16 && !failed) {
        uint16_t *dst = out;
        for (int64_t i = 0; i < rows * n; i++) dst[i] = float_to_bf16(wide[i]);
    }
    free(views);
    free(wide);
    free(scratch);
    return failed;
}
