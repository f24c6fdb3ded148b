"""How far ahead should the block matmul prefetch? 30 layers' four projections of the default
model (Q4 blocks, about 66 MB: far past the caches, as in a decode step) at 1, 8 and 16 rows,
for prefetch distances of 0 (the block in hand: no look-ahead), 32 (the kernel's default
except on AVX-512 VNNI), 64 (its default there) and 128, in the build for this CPU and the AVX2
build, side by side in one process, interleaved. Writes
benchmarks/OUT_SUBDIR/prefetch-distance.{md,json}.

Run: .venv/bin/python benchmarks/scripts/prefetch_distance.py [OUT_SUBDIR]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
from dense_tiles import LAYERS
from dense_tiles import SHAPES as PROJECTIONS

from forklift.bench.report import cpu_flags, write_report_files
from forklift.cpu import native_arch_flags
from forklift.model.layers.block_weights import BlockInt4
from forklift.native.quant_matmul import QuantMatmulKernel

DISTANCES = (0, 32, 64, 128)
ROWS = (1, 8, 16)
ROUNDS = 9
BUILDS = {"native": native_arch_flags(), "avx2": ("-march=x86-64-v3", "-mtune=native")}


def _default_distance(build: str, flags: list[str]) -> int:
    """PREFETCH_BLOCKS in csrc/isa/isa.h: 64 where the build has AVX-512 VNNI, else 32."""
    vnni = {"avx512f", "avx512bw", "avx512_vnni"} <= set(flags)
    return 64 if build == "native" and vnni else 32


def _time_layers(layers: list[list[BlockInt4]], xs: list[torch.Tensor]) -> float:
    start = time.perf_counter()
    for layer in layers:
        for weight, x in zip(layer, xs, strict=True):
            weight.linear(x)
    return time.perf_counter() - start


def main() -> None:
    out = Path(__file__).resolve().parents[1] / (sys.argv[1] if len(sys.argv) > 1 else "")
    torch.set_num_threads(2)
    torch.manual_seed(0)
    dense = [[torch.randn(n, k) * 0.05 for n, k in PROJECTIONS] for _ in range(LAYERS)]
    results = []
    for build, arch in BUILDS.items():
        kernels = {d: QuantMatmulKernel.load((*arch, f"-DPREFETCH_BLOCKS={d}")) for d in DISTANCES}
        layers = {d: [[BlockInt4.from_dense(w, k) for w in ws] for ws in dense]
                  for d, k in kernels.items()}  # fmt: skip
        megabytes = sum(w.nbytes for ws in layers[DISTANCES[0]] for w in ws) / 1e6
        for rows in ROWS:
            xs = [torch.randn(rows, k) for _, k in PROJECTIONS]
            times: dict[int, list[float]] = {d: [] for d in DISTANCES}
            for _ in range(ROUNDS):
                for d in DISTANCES:
                    times[d].append(_time_layers(layers[d], xs))
            for d in DISTANCES:
                ms = statistics.median(times[d]) * 1e3
                results.append({"build": build, "rows": rows, "prefetch_blocks": d, "ms": ms,
                                "gb_per_s": megabytes / ms})  # fmt: skip
                print(results[-1], flush=True)
    report = {"cpu_flags": cpu_flags(), "threads": 2, "rounds": ROUNDS, "megabytes": megabytes,
              "command": f".venv/bin/python benchmarks/scripts/prefetch_distance.py {out.name}",
              "results": results}  # fmt: skip
    write_report_files(report, out, "prefetch-distance", render_markdown, plot=None)


def render_markdown(report: dict) -> str:
    lines = [
        "# Block matmul: how far ahead to prefetch",
        "",
        f"Command: `{report['command']}`; 2 threads, median of {report['rounds']} interleaved "
        f"rounds. CPU flags: {' '.join(report['cpu_flags'])}.",
        "",
        f"{LAYERS} layers of the default model's projections as Q4 blocks "
        f"({report['megabytes']:.1f} MB, far past the caches), one call per projection (the "
        "Python call is in the time). Prefetch distance in blocks of the stream: 0 fetches the "
        "block in hand (no look-ahead); the last columns: each build's default and its rate.",
        "",
        "| build | rows | "
        + " | ".join(f"{d} blocks (ms)" for d in DISTANCES)
        + " | default | GB/s at default |",
        "|---|---:|" + "---:|" * (len(DISTANCES) + 2),
    ]
    for build in BUILDS:
        for rows in ROWS:
            cell = {r["prefetch_blocks"]: r for r in report["results"]
                    if r["build"] == build and r["rows"] == rows}  # fmt: skip
            default = _default_distance(build, report["cpu_flags"])
            lines.append(
                f"| {build} | {rows} | "
                + " | ".join(f"{cell[d]['ms']:.2f}" for d in DISTANCES)
                + f" | {default} | {cell[default]['gb_per_s']:.1f} |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
