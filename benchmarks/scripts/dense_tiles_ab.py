"""The dense bf16 tile matmul (forklift/native/csrc/dense_matmul_amx.h) of this tree against the
one of a git revision, side by side in one process: the default model's shapes as
`dense_tiles.py` runs them (30 layers of projections streaming from memory, then the LM
head), each library's call alternating round by round at 1 to 64 rows. Writes
benchmarks/<dir>/<name>.{md,json} (name: dense-tiles-ab unless given).

Run: .venv/bin/python benchmarks/scripts/dense_tiles_ab.py REV [out_dir [name]]
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from dense_tiles import HIDDEN, LAYERS, ROWS, SHAPES, VOCAB
from results import command_line, write_results
from revision_build import CSRC, ROOT, build_library, checkout_sources

from forklift.bench.report import cpu_flags
from forklift.native.dense_weights import DenseMatmulKernel, pack_dense_all

ROUNDS = 9


def _run(kernel: DenseMatmulKernel, weights: list, tiles: list, inputs: dict) -> float:
    started = time.perf_counter()
    for weight, packed in zip(weights, tiles, strict=True):
        kernel(inputs[weight.shape[1]], packed, weight.shape[0])
    return time.perf_counter() - started


def main() -> None:
    revision = sys.argv[1]
    out_dir = Path(sys.argv[2]).resolve() if len(sys.argv) > 2 else ROOT / "benchmarks"
    stem = sys.argv[3] if len(sys.argv) > 3 else "dense-tiles-ab"
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=gen).bfloat16()
               for _ in range(LAYERS) for n, k in SHAPES]  # fmt: skip
    weights.append(torch.randn(VOCAB, HIDDEN, generator=gen).bfloat16())
    tiles, _ = pack_dense_all(weights)
    parts = {"layers": slice(0, -1), "head": slice(-1, None)}
    torch.set_grad_enabled(False)
    with tempfile.TemporaryDirectory() as scratch:
        base = checkout_sources(revision, Path(scratch) / "base")
        libraries = {
            revision: build_library(base, "dense_matmul", Path(scratch) / "base.so"),
            "this tree": build_library(ROOT / CSRC, "dense_matmul", Path(scratch) / "tree.so"),
        }
        # The check also asks the kernel for the tile state, which the products need.
        assert all(lib.forklift_dense_tiles_available() for lib in libraries.values())
        kernels = {name: DenseMatmulKernel(lib) for name, lib in libraries.items()}
        results = []
        for rows in ROWS:
            inputs = {k: torch.randn(rows, k, generator=gen) for _, k in SHAPES}
            times = {(name, part): [] for name in kernels for part in parts}
            for _ in range(ROUNDS):
                for name, kernel in kernels.items():
                    for part, chosen in parts.items():
                        seconds = _run(kernel, weights[chosen], tiles[chosen], inputs)
                        times[name, part].append(seconds)
            ms = {f"{name} {part}": statistics.median(t) * 1e3 for (name, part), t in times.items()}
            results.append({"rows": rows, "ms": ms})
            print(results[-1], flush=True)
    report = {"cpu_flags": cpu_flags(), "baseline": revision, "rounds": ROUNDS, "rows": results}
    lines = [
        "# Dense bf16 tile matmuls: this tree against a baseline revision",
        "",
        f"The default model's shapes in bf16 ({LAYERS} layers of projections, each its own "
        f"weights, then the {VOCAB} x {HIDDEN} LM head), 2 threads, each call from Python; the "
        f"two builds alternate round by round, median of {ROUNDS} rounds.",
        "",
        f"| rows | {revision} layers (ms) | this tree layers (ms) | speed-up | "
        f"{revision} head (ms) | this tree head (ms) | speed-up |",
        "|---:|---:|---:|---:|---:|---:|---:|",
        *(
            f"| {r['rows']} | {r['ms'][f'{revision} layers']:.2f} | "
            f"{r['ms']['this tree layers']:.2f} | "
            f"{r['ms'][f'{revision} layers'] / r['ms']['this tree layers']:.2f}x | "
            f"{r['ms'][f'{revision} head']:.2f} | {r['ms']['this tree head']:.2f} | "
            f"{r['ms'][f'{revision} head'] / r['ms']['this tree head']:.2f}x |"
            for r in results
        ),
        "",
    ]
    write_results(out_dir, stem, report, lines, command_line(__file__, out_dir))


if __name__ == "__main__":
    main()
