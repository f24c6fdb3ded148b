/* What every kernel here shares: this build's instruction set (isa/isa.h: its vector
 * helpers, capability macros and the bf16 and fp16 conversions) and values of the model's
 * dtype. */
#ifndef FORKLIFT_COMMON_H
#define FORKLIFT_COMMON_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "isa/isa.h"

/* Value i of a tensor in the model's dtype: bf16, or fp32. */
static inline float dtype_value(const void *base, int64_t i, int is_bf16) {
    return is_bf16 ? bf16_to_float(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

static inline void store_value(void *base, int64_t i, float v, int is_bf16) {
    if (is_bf16)
        ((uint16_t *)base)[i] = float_to_bf16(v);
    else
        ((float *)base)[i] = v;
}

#endif
