/* AMX's shared pieces (the tile kernels live with their operations: quant_matmul_amx.h,
 * dense_matmul_amx.h, paged_attention_amx.h): the process's grant of the tile state (asked
 * once: amx_tiles_usable), ldtilecfg's operand, and tile-state release. */
#ifndef FORKLIFT_ISA_AMX_H
#define FORKLIFT_ISA_AMX_H

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

/* Linux hands out AMX's tile data state only on request (arch_prctl, XFEATURE_XTILEDATA);
 * 1 once this process has it. */
static inline int amx_tiles_granted(void) {
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
}

/* amx_tiles_granted, asked of the kernel once per process (the answer never changes): the
 * matmuls and attention ask before every call that would use the tiles. */
static inline int amx_tiles_usable(void) {
    static int usable = -1; /* -1: not asked yet; threads that race store the same answer */
    int known = __atomic_load_n(&usable, __ATOMIC_RELAXED);
    if (known < 0) {
        known = amx_tiles_granted();
        __atomic_store_n(&usable, known, __ATOMIC_RELAXED);
    }
    return known;
}

/* ldtilecfg's 64-byte operand: palette 1, then per tile its bytes per row and rows. */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed, aligned(64))) AmxTileConfig;
_Static_assert(sizeof(AmxTileConfig) == 64, "ldtilecfg reads 64 bytes");

/* This thread's tiles back to their initial state (after a kernel's last tile product). */
static inline void amx_tiles_release(void) { _tile_release(); }

#endif
