"""Which cache should the block matmul's look-ahead prefetches fill? The same kernels built
with PREFETCH_LOCALITY 3 (prefetcht0, into L1) and 1 (prefetcht2, into L2), for this CPU and
as the AVX2 kind, side by side in one process, interleaved, on weights far past the caches:
Gemma 3 270M's tied head shape (262144 x 640 Q8 blocks, precise, 178 MB), the default
model's head (49152 x 576 Q8, precise) and its 30 layers of projections (Q4 blocks, each
layer its own weights). Every pair of builds must give the same outputs bit for bit.
Writes benchmarks/OUT_SUBDIR/prefetch-locality.{md,json}.

Run: .venv/bin/python benchmarks/scripts/prefetch_locality.py [OUT_SUBDIR]
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from dense_tiles import HIDDEN, LAYERS, VOCAB
from dense_tiles import SHAPES as PROJECTIONS

from forklift.bench.report import cpu_flags, write_report_files
from forklift.cpu import native_arch_flags
from forklift.model.layers.block_weights import BlockInt4, BlockInt8
from forklift.native.quant_matmul import QuantMatmulKernel

LOCALITIES = (3, 1)
GEMMA_VOCAB, GEMMA_HIDDEN = 262144, 640
ROWS = (1, 4, 8, 16)
ROUNDS, CALLS = 7, 3
BUILDS = {"native": native_arch_flags(), "avx2": ("-march=x86-64-v3", "-mtune=native")}


@dataclasses.dataclass
class Workload:
    name: str
    megabytes: float
    run: dict[int, Callable[[int], torch.Tensor]]  # locality -> rows -> last output


def _heads(name: str, weight: torch.Tensor, kernels: dict[int, QuantMatmulKernel]) -> Workload:
    heads = {
        locality: dataclasses.replace(BlockInt8.from_dense(weight, kernel), precise=True)
        for locality, kernel in kernels.items()
    }
    inputs = {rows: torch.randn(rows, weight.shape[1]) for rows in ROWS}
    megabytes = heads[LOCALITIES[0]].nbytes / 1e6
    run = {loc: (lambda rows, h=h: h.linear(inputs[rows])) for loc, h in heads.items()}
    return Workload(name, megabytes, run)


def _layers(dense: list[list[torch.Tensor]], kernels: dict[int, QuantMatmulKernel]) -> Workload:
    layers = {
        locality: [[BlockInt4.from_dense(w, kernel) for w in ws] for ws in dense]
        for locality, kernel in kernels.items()
    }
    inputs = {rows: [torch.randn(rows, k) for _, k in PROJECTIONS] for rows in ROWS}

    def run_layers(rows: int, built: list[list[BlockInt4]]) -> torch.Tensor:
        outputs = [w.linear(x) for layer in built for w, x in zip(layer, inputs[rows], strict=True)]
        return torch.cat([o.flatten() for o in outputs])

    megabytes = sum(w.nbytes for ws in layers[LOCALITIES[0]] for w in ws) / 1e6
    run = {loc: (lambda rows, b=b: run_layers(rows, b)) for loc, b in layers.items()}
    return Workload(f"default model's {LAYERS} layers (Q4)", megabytes, run)


def main() -> None:
    out = Path(__file__).resolve().parents[1] / (sys.argv[1] if len(sys.argv) > 1 else "")
    torch.set_num_threads(2)
    torch.manual_seed(0)
    gemma_head = torch.randn(GEMMA_VOCAB, GEMMA_HIDDEN)
    default_head = torch.randn(VOCAB, HIDDEN)
    dense = [[torch.randn(n, k) * 0.05 for n, k in PROJECTIONS] for _ in range(LAYERS)]
    results = []
    for build, arch in BUILDS.items():
        kernels = {
            loc: QuantMatmulKernel.load((*arch, f"-DPREFETCH_LOCALITY={loc}")) for loc in LOCALITIES
        }
        workloads = [
            _heads("Gemma 3 270M's head (Q8, precise)", gemma_head, kernels),
            _heads("default model's head (Q8, precise)", default_head, kernels),
            _layers(dense, kernels),
        ]
        for workload in workloads:
            for rows in ROWS:
                outputs = [workload.run[loc](rows) for loc in LOCALITIES]
                same = all(torch.equal(outputs[0], o) for o in outputs[1:])
                times: dict[int, list[float]] = {loc: [] for loc in LOCALITIES}
                for _ in range(ROUNDS):
                    for loc in LOCALITIES:
                        start = time.perf_counter()
                        for _ in range(CALLS):
                            workload.run[loc](rows)
                        times[loc].append((time.perf_counter() - start) / CALLS)
                ms = {str(loc): statistics.median(t) * 1e3 for loc, t in times.items()}
                results.append({"build": build, "workload": workload.name, "rows": rows,
                                "megabytes": workload.megabytes, "ms": ms,
                                "speedup": ms["3"] / ms["1"], "bit_identical": same})  # fmt: skip
                print(results[-1], flush=True)
    report = {"cpu_flags": cpu_flags(), "threads": 2, "rounds": ROUNDS, "calls": CALLS,
              "command": f".venv/bin/python benchmarks/scripts/prefetch_locality.py {out.name}",
              "results": results}  # fmt: skip
    write_report_files(report, out, "prefetch-locality", render_markdown, plot=None)


def render_markdown(report: dict) -> str:
    lines = [
        "# Block matmul: which cache the look-ahead prefetches fill",
        "",
        f"Command: `{report['command']}`; {report['threads']} threads, median of "
        f"{report['rounds']} interleaved rounds of {report['calls']} calls. CPU flags: "
        f"{' '.join(report['cpu_flags'])}.",
        "",
        "The same kernels built with `PREFETCH_LOCALITY` 3 (`prefetcht0`, into L1) and 1 "
        "(`prefetcht2`, into L2), 64 blocks ahead on the AVX-512 VNNI build and 32 on the "
        "AVX2 one; `native` is this CPU's build, `avx2` the AVX2 kind's. Weights far past the "
        "caches; the Python call is in the time.",
        "",
        "| build | weights | MB | rows | L1 (ms) | L2 (ms) | speed-up | GB/s into L2 "
        "| same outputs |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in report["results"]:
        lines.append(
            f"| {r['build']} | {r['workload']} | {r['megabytes']:.1f} | {r['rows']} | "
            f"{r['ms']['3']:.2f} | {r['ms']['1']:.2f} | {r['speedup']:.2f}x | "
            f"{r['megabytes'] / r['ms']['1']:.1f} | "
            f"{'bit for bit' if r['bit_identical'] else 'no'} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
