"""The native block matmul of this tree against the one of a git revision, side by side in one
process, on the default model's LM head shape (49152 x 576 Q8 blocks, precise activations, as
the decode step runs it) and its 30 layers of projections (Q4 blocks, each layer its own
weights): each build's kernel alternating, rows 1 to 32 unless a comma-separated list of
row counts is given (prefill chunks: 512, 2048). Writes benchmarks/<dir>/<name>.{md,json}
(name: quant-matmul-ab unless given).

Run: .venv/bin/python benchmarks/scripts/quant_matmul_ab.py REV [out_dir [name [rows]]]
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from dense_tiles import HIDDEN, LAYERS, SHAPES, VOCAB
from results import command_line, write_results
from revision_build import CSRC, ROOT, build_library, checkout_sources

from forklift.bench.report import cpu_flags
from forklift.model.layers.block_weights import BlockInt4, BlockInt8
from forklift.native.quant_matmul import QuantMatmulKernel

ROWS = (1, 2, 4, 8, 16, 24, 32)
ROUNDS, CALLS = 7, 5


def _layers_ms(layers: list[BlockInt4], inputs: dict[int, torch.Tensor]) -> float:
    started = time.perf_counter()
    for layer in layers:
        layer.linear(inputs[layer.shape[1]])
    return (time.perf_counter() - started) * 1e3


def main() -> None:
    revision = sys.argv[1]
    out_dir = Path(sys.argv[2]).resolve() if len(sys.argv) > 2 else ROOT / "benchmarks"
    stem = sys.argv[3] if len(sys.argv) > 3 else "quant-matmul-ab"
    rows_list = tuple(int(r) for r in sys.argv[4].split(",")) if len(sys.argv) > 4 else ROWS
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(VOCAB, HIDDEN, generator=gen)
    layer_weights = [torch.randn(n, k, generator=gen) for _ in range(LAYERS) for n, k in SHAPES]
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
        layers = {
            name: [BlockInt4.from_dense(w, kernel) for w in layer_weights]
            for name, kernel in kernels.items()
        }
        results = []
        for rows in rows_list:
            x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(rows))
            inputs = {k: torch.randn(rows, k, generator=gen) for k in {k for _, k in SHAPES}}
            outputs = {name: head.linear(x) for name, head in heads.items()}
            same = torch.equal(*outputs.values()) and all(
                torch.equal(*(layers[name][i].linear(inputs[w.shape[1]]) for name in layers))
                for i, w in enumerate(layer_weights[: len(SHAPES)])
            )
            times: dict[str, list[float]] = {name: [] for name in heads}
            layer_times: dict[str, list[float]] = {name: [] for name in heads}
            for _ in range(ROUNDS):
                for name, head in heads.items():
                    started = time.perf_counter()
                    for _ in range(CALLS):
                        head.linear(x)
                    times[name].append((time.perf_counter() - started) / CALLS)
                    layer_times[name].append(_layers_ms(layers[name], inputs))
            ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
            layers_ms = {name: statistics.median(t) for name, t in layer_times.items()}
            results.append({"rows": rows, "ms": ms, "speedup": ms[revision] / ms["this tree"],
                            "layers_ms": layers_ms,
                            "layers_speedup": layers_ms[revision] / layers_ms["this tree"],
                            "bit_identical": same})  # fmt: skip
            print(results[-1], flush=True)
    report = {"cpu_flags": cpu_flags(), "baseline": revision, "shape": [VOCAB, HIDDEN],
              "rounds": ROUNDS, "calls": CALLS, "rows": results}  # fmt: skip
    lines = [
        "# Block matmul: this tree against a baseline revision",
        "",
        f"The default model's LM head shape ({VOCAB} x {HIDDEN} Q8 blocks, precise activations: "
        f"the build's wide rows or two int8 rows per row; median of {ROUNDS} rounds x {CALLS} "
        f"calls) and its {LAYERS} "
        "layers of projections (Q4 blocks, each layer its own weights; median of "
        f"{ROUNDS} rounds), {torch.get_num_threads()} threads, the two builds alternating.",
        "",
        f"| rows | {revision} head (ms) | this tree head (ms) | speed-up | {revision} layers (ms) "
        "| this tree layers (ms) | speed-up | same outputs |",
        "|---:|---:|---:|---:|---:|---:|---:|---|",
        *(
            f"| {r['rows']} | {r['ms'][revision]:.2f} | {r['ms']['this tree']:.2f} | "
            f"{r['speedup']:.2f}x | {r['layers_ms'][revision]:.2f} | "
            f"{r['layers_ms']['this tree']:.2f} | {r['layers_speedup']:.2f}x | "
            f"{'bit for bit' if r['bit_identical'] else 'no'} |"
            for r in results
        ),
        "",
    ]
    extra = (",".join(map(str, rows_list)),) if rows_list != ROWS else ()
    write_results(
        out_dir, stem, report, lines, command_line(__file__, revision, out_dir, stem, *extra)
    )


if __name__ == "__main__":
    main()
