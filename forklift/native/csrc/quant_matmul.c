/* The quantized matmul of quant_matmul.h as one exported call: x [rows, K] (fp32 or bf16)
 * times the weight's blocks, out [rows, N] in x's dtype. */
#include "quant_matmul.h"

#include <omp.h>

/* Returns 0 on success, 1 when scratch memory could not be allocated. */
int forklift_quant_matmul(const void *x, int64_t rows, int64_t k, const void *codes,
                          const uint16_t *d, const uint16_t *m, int64_t n, void *out,
                          int is_bf16, int num_threads) {
    QuantizedRow *views = malloc(sizeof(QuantizedRow) * (size_t)rows);
    float *wide = malloc(sizeof(float) * (size_t)(rows * (k > n ? k : n)));
    int8_t *scratch = views == NULL ? NULL : quantized_rows_alloc(rows, k, views);
    if (views == NULL || wide == NULL || scratch == NULL) {
        free(views);
        free(wide);
        free(scratch);
        return 1;
    }
    for (int64_t r = 0; r < rows; r++) {
        float *row = wide + r * k;
        if (is_bf16) {
            const uint16_t *src = (const uint16_t *)x + r * k;
            for (int64_t i = 0; i < k; i++) row[i] = bf16_to_float(src[i]);
        } else {
            memcpy(row, (const float *)x + r * k, sizeof(float) * (size_t)k);
        }
        quantize_row(row, k, views[r]);
    }
    const QuantWeight weight = {codes, d, m, n, k};
    const int64_t groups = (n + 7) / 8;
    float *result = is_bf16 ? wide : (float *)out;
#pragma omp parallel num_threads(num_threads)
    {
        const int64_t threads = omp_get_num_threads(), id = omp_get_thread_num();
        const int64_t per = (groups + threads - 1) / threads;
        const int64_t begin = id * per < groups ? id * per : groups;
        const int64_t end = begin + per < groups ? begin + per : groups;
        quant_matmul_range(&weight, views, rows, result, begin, end);
    }
    if (is_bf16) {
        uint16_t *dst = out;
        for (int64_t i = 0; i < rows * n; i++) dst[i] = float_to_bf16(wide[i]);
    }
    free(views);
    free(wide);
    free(scratch);
    return 0;
}
