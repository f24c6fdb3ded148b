"""Dense bf16 matmuls on AMX tiles (forklift/native/csrc/dense_matmul_amx.h) against oneDNN's
packed bf16 linear (what the PyTorch layers run), side by side in one process: the default
model's 30 layers of projections (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536,
each layer its own weights, so they stream from memory as in a decode step) and its 49152x576
LM head, at 1 to 64 rows. The tile weights sit in one huge-page buffer, as the decode step
packs them. Writes benchmarks/<dir>/dense-tiles.{md,json}.

Run: .venv/bin/python benchmarks/scripts/dense_tiles.py [out_dir]
"""

from __future__ import annotations

import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch
from results import command_line, write_results
from revision_build import ROOT

from forklift.bench.report import cpu_flags
from forklift.model.layers.linear import pack_weight, packed_linear
from forklift.native.dense_weights import DenseMatmulKernel, pack_dense_all

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
LAYERS, VOCAB, HIDDEN = 30, 49152, 576
ROWS = (1, 8, 16, 32, 64)
ROUNDS = 5


def _tiles(kernel: DenseMatmulKernel, weights: list, tiles: list, inputs: dict) -> None:
    for weight, packed in zip(weights, tiles, strict=True):
        kernel(inputs[weight.shape[1]], packed, weight.shape[0])


def _onednn(weights: list, packs: list, inputs: dict) -> None:
    for weight, packed in zip(weights, packs, strict=True):
        packed_linear(inputs[weight.shape[1]], weight, packed, None)


def main() -> None:
    out_dir = Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else ROOT / "benchmarks"
    kernel = DenseMatmulKernel.load()
    assert kernel is not None, "no AMX tiles here"
    gen = torch.Generator().manual_seed(0)
    layers = [[torch.randn(n, k, generator=gen).bfloat16() for n, k in SHAPES]
              for _ in range(LAYERS)]  # fmt: skip
    head = torch.randn(VOCAB, HIDDEN, generator=gen).bfloat16()
    tiles, _ = pack_dense_all([w for layer in layers for w in layer] + [head])
    onednn = [pack_weight(w) for layer in layers for w in layer] + [pack_weight(head)]
    weights = [w for layer in layers for w in layer] + [head]
    results = []
    torch.set_grad_enabled(False)
    for rows in ROWS:
        inputs = {k: torch.randn(rows, k, generator=gen) for k in {k for _, k in SHAPES}}
        halves = {k: x.bfloat16() for k, x in inputs.items()}
        times: dict[str, list[float]] = {name: [] for name in
                                         ("tiles layers", "onednn layers", "tiles head",
                                          "onednn head")}  # fmt: skip
        runs = {
            "tiles layers": partial(_tiles, kernel, weights[:-1], tiles[:-1], inputs),
            "onednn layers": partial(_onednn, weights[:-1], onednn[:-1], halves),
            "tiles head": partial(_tiles, kernel, weights[-1:], tiles[-1:], inputs),
            "onednn head": partial(_onednn, weights[-1:], onednn[-1:], halves),
        }
        for _ in range(ROUNDS):
            for name, run in runs.items():
                started = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - started)
        ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        results.append({"rows": rows, "ms": ms})
        print(results[-1], flush=True)
    report = {"cpu_flags": cpu_flags(), "rounds": ROUNDS, "rows": results}
    lines = [
        "# Dense bf16 matmuls: AMX tiles against oneDNN",
        "",
        f"The default model's shapes in bf16: {LAYERS} layers of projections (each its own "
        f"weights, {sum(n * k for n, k in SHAPES) * LAYERS * 2 / 1e6:.0f} MB) and the "
        f"{VOCAB} x {HIDDEN} LM head; `tiles`: forklift's AMX kernel (the native decode "
        "step's), `onednn`: PyTorch's packed bf16 linear (the PyTorch layers'). 2 threads, "
        f"median of {ROUNDS} rounds, each call from Python.",
        "",
        "| rows | tiles layers (ms) | oneDNN layers (ms) | speed-up | tiles head (ms) | "
        "oneDNN head (ms) | speed-up |",
        "|---:|---:|---:|---:|---:|---:|---:|",
        *(
            f"| {r['rows']} | {r['ms']['tiles layers']:.2f} | {r['ms']['onednn layers']:.2f} | "
            f"{r['ms']['onednn layers'] / r['ms']['tiles layers']:.2f}x | "
            f"{r['ms']['tiles head']:.2f} | {r['ms']['onednn head']:.2f} | "
            f"{r['ms']['onednn head'] / r['ms']['tiles head']:.2f}x |"
            for r in results
        ),
        "",
    ]
    write_results(out_dir, "dense-tiles", report, lines, command_line(__file__, out_dir))


if __name__ == "__main__":
    main()
