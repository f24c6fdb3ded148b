"""Do AMX tile products hide a stream of weights from memory? One thread streams bf16 weight
tiles (1 KB each) from a 256 MB buffer, far past the caches, and for each pair of tiles runs
0, 2, 4 or 8 tile products per kilobyte on activation tiles that stay in L1, as the dense
decode matmul's 2 x 2 blocking does at 32 rows and beyond. The weights reach the tile unit
three ways: loaded as tiles (what the kernel does), only prefetched (the products then use
tiles already in L1), or copied through an L1 ring with vector loads first. If products
overlapped the stream, its rate would hold until the products take longer than the reads.
Writes benchmarks/<dir>/amx-streaming.{md,json}.

Run: .venv/bin/python benchmarks/scripts/amx_streaming.py [out_dir]
"""

from __future__ import annotations

import sys
from pathlib import Path

from c_harness import compiled
from results import command_line, write_results
from revision_build import ROOT

from forklift.bench.report import cpu_flags

SOURCE = r"""
int main(int argc, char **argv) {
    /* 0: tile loads, 1: prefetch only, 2: copy via L1, 3: no weights (the products alone) */
    const int mode = atoi(argv[1]);
    const int passes = atoi(argv[2]); /* 2 x 2 product passes per pair of weight tiles */
    if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) return 2;
    TileConfig config = {.palette = 1};
    for (int t = 0; t < 8; t++) {
        config.colsb[t] = 64;
        config.rows[t] = 16;
    }
    _tile_loadconfig(&config);
    const size_t bytes = (size_t)256 << 20, tiles = bytes / 1024;
    uint16_t *weights = aligned_alloc(4096, bytes);
    for (size_t i = 0; i < bytes / 2; i++) weights[i] = (uint16_t)(0x3f80 ^ (i & 0x7f));
    static uint16_t activations[32 * 576] __attribute__((aligned(64)));
    static uint16_t ring[16][1024] __attribute__((aligned(64)));
    float sums[256] __attribute__((aligned(64)));
    double elapsed = 0;
    for (int round = 0; round < 2; round++) { /* the first touches the pages */
        const double start = seconds();
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (size_t t = 0; t + 1 < tiles; t += 2) {
            const char *pair = (const char *)(weights + t * 512);
            /* 16 KB ahead into L2; past the buffer's end a prefetch never faults (the
             * address formed as an integer, not a pointer past the array). */
            const uintptr_t ahead = (uintptr_t)pair + 16 * 1024;
            if (mode != 3)
                for (int line = 0; line < 2048; line += 64)
                    _mm_prefetch((const char *)(ahead + line), _MM_HINT_T1);
            if (mode == 0) {
                _tile_loadd(6, pair, 64);
                _tile_loadd(7, pair + 1024, 64);
            } else if (mode == 1 || mode == 3) {
                _tile_loadd(6, ring[0], 64);
                _tile_loadd(7, ring[1], 64);
            } else {
                __m512i *copy = (__m512i *)ring[(t / 2) % 8 * 2];
                for (int v = 0; v < 32; v++)
                    _mm512_store_si512(copy + v, _mm512_load_si512((const __m512i *)pair + v));
                _tile_loadd(6, copy, 64);
                _tile_loadd(7, (const char *)copy + 1024, 64);
            }
            const int64_t k = (int64_t)(t / 2) % 18;
            for (int p = 0; p < passes; p++) {
                _tile_loadd(4, activations + 32 * k, 1152);
                _tile_dpbf16ps(0, 4, 6);
                _tile_loadd(5, activations + 16 * 576 + 32 * k, 1152);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(1, 4, 7);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
        _tile_stored(0, sums, 64);
        elapsed = seconds() - start;
    }
    _tile_release();
    printf("%.3f %.6f\n", bytes / elapsed / 1e9, (double)sums[0]);
    return 0;
}
"""

MODES = {0: "tile loads", 1: "prefetch only", 2: "copied via L1", 3: "products alone"}
PASSES = (0, 1, 2, 4)  # 2 x 2 passes per pair of tiles: 2 passes = 4 products per kilobyte


def main() -> None:
    out_dir = Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else ROOT / "benchmarks"
    assert "amx_bf16" in cpu_flags(), "a measurement for CPUs with AMX"
    results = []
    with compiled(SOURCE, "streaming", "-O2") as run:
        for passes in PASSES:
            for mode, name in MODES.items():
                rate = run(mode, passes)
                results.append({"mode": name, "products_per_kb": 2 * passes, "gb_per_s": rate})
                print(results[-1], flush=True)
    report = {"cpu_flags": cpu_flags(), "buffer_mb": 256, "results": results}
    rate = {(r["mode"], r["products_per_kb"]): r["gb_per_s"] for r in results}

    def one_after_the_other(products: int) -> float:
        """The tile loads' rate if the stream and the products took their times in turn."""
        alone = rate["tile loads", 0]
        return 1 / (1 / alone + 1 / rate["products alone", products]) if products else alone

    lines = [
        "# AMX tile products against a stream of weights",
        "",
        "One thread streams bf16 weight tiles (1 KB each) from a 256 MB buffer and runs tile "
        "products beside them on activation tiles that stay in L1; the rate at which the "
        "weights pass (GB/s), by how the weights reach the tile unit and by products per "
        "kilobyte of weights (the dense decode matmul runs 2 at up to 32 rows, 4 at 64). "
        "`products alone`: the same products with no weights streaming, as the rate they "
        "would allow; the last column, the tile loads' rate were the stream and the products "
        "to take their times one after the other.",
        "",
        "| products per KB | " + " | ".join(MODES.values()) + " | one after the other |",
        "|---:|" + "---:|" * (len(MODES) + 1),
        *(
            f"| {2 * p} | "
            + " | ".join(
                "-" if (m, p) == ("products alone", 0) else f"{rate[m, 2 * p]:.1f}"
                for m in MODES.values()
            )
            + f" | {one_after_the_other(2 * p):.1f} |"
            for p in PASSES
        ),  # fmt: skip
        "",
    ]
    write_results(out_dir, "amx-streaming", report, lines, command_line(__file__, out_dir))


if __name__ == "__main__":
    main()
