"""The native block matmul of this tree against the one of a git revision, side by side in one
process, on the default model's LM head shape (49152 x 576 Q8 blocks, precise activations, as
the decode step runs it): each build's kernel alternating, rows 1 to 16. Writes
benchmarks/<dir>/quant-matmul-ab.{md,json}.

Run: .venv/bin/python benchmarks/scripts/quant_matmul_ab.py REV [out_dir]
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from results import command_line, write_results
from revision_build import CSRC, ROOT, build_library, checkout_sources

from forklift.bench.report import cpu_flags
from forklift.native.quant_matmul import BlockInt8, QuantMatmulKernel

VOCAB, HIDDEN = 49152, 576
ROWS = (1, 2, 4, 8, 16)
ROUNDS, CALLS = 7, 5


def main() -> None:
    revision = sys.argv[1]
    out_dir = Path(sys.argv[2]).resolve() if len(sys.argv) > 2 else ROOT / "benchmarks"
    weight = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(0))
    with tempfile.TemporaryDirectory() as scratch:
        base = checkout_sources(revision, Path(scratch) / "base")
        kernels = {
            revision: QuantMatmulKernel(
                build_library(base, "quant_matmul", Path(scratch) / "base.so")
            ),
            "this tree": QuantMatmulKernel(
                build_library(ROOT / CSRC, "quant_matmul", Path(scratch) / "t.so")
            ),
        }
        heads = {
            name: dataclasses.replace(BlockInt8.from_dense(weight, kernel), precise=True)
            for name, kernel in kernels.items()
        }
        results = []
        for rows in ROWS:
            x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(rows))
            outputs = {name: head.linear(x) for name, head in heads.items()}
            same = torch.equal(*outputs.values())
            times: dict[str, list[float]] = {name: [] for name in heads}
            for _ in range(ROUNDS):
                for name, head in heads.items():
                    started = time.perf_counter()
                    for _ in range(CALLS):
                        head.linear(x)
                    times[name].append((time.perf_counter() - started) / CALLS)
            ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
            results.append({"rows": rows, "ms": ms, "speedup": ms[revision] / ms["this tree"],
                            "bit_identical": same})  # fmt: skip
            print(results[-1], flush=True)
    report = {"cpu_flags": cpu_flags(), "baseline": revision, "shape": [VOCAB, HIDDEN],
              "rounds": ROUNDS, "calls": CALLS, "rows": results}  # fmt: skip
    lines = [
        "# Block matmul: this tree against a baseline revision",
        "",
        f"The default model's LM head shape ({VOCAB} x {HIDDEN} Q8 blocks, precise activations: "
        f"two int8 rows per row), 2 threads, the two builds alternating: median of {ROUNDS} "
        f"rounds x {CALLS} calls.",
        "",
        f"| rows | {revision} (ms) | this tree (ms) | speed-up | same outputs |",
        "|---:|---:|---:|---:|---|",
        *(
            f"| {r['rows']} | {r['ms'][revision]:.2f} | {r['ms']['this tree']:.2f} | "
            f"{r['speedup']:.2f}x | {'bit for bit' if r['bit_identical'] else 'no'} |"
            for r in results
        ),
        "",
    ]
    write_results(
        out_dir, "quant-matmul-ab", report, lines, command_line(__file__, revision, out_dir)
    )


if __name__ == "__main__":
    main()
