"""Do AMX tiles pay for the block matmul? One layer's four projections of the default model
(Q4 blocks) and its LM head (Q8 blocks, precise), rows 1-64, three ways side by side in one
process: the kernel built for this CPU with its AMX tile path, the same kernel built without
AMX (AVX-512 VNNI tiles), and PyTorch's dense bf16 linear (oneDNN, AMX-BF16 on such CPUs).
Medians of interleaved rounds. Writes benchmarks/amx-tiles.{md,json}.

The AMX path was measured and removed (benchmarks/amx-tiles.md): run this on an AMX CPU
with commit afd8e19 checked out and PREFETCH_BLOCKS set to 32 in its quant_matmul.h:
.venv/bin/python benchmarks/scripts/amx_tiles.py
"""

from __future__ import annotations

import json
import statistics
import subprocess
import time
from pathlib import Path

import torch

from forklift.bench.report import cpu_flags
from forklift.model.layers.block_weights import BlockInt4, BlockInt8
from forklift.native.quant_matmul import QuantMatmulKernel

PROJECTIONS = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
HEAD = (49152, 576)
ROWS = (1, 2, 4, 8, 16, 32, 64)
ROUNDS = 7
NO_AMX = ("-march=native", "-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16")
OUT = Path(__file__).resolve().parents[1]


def _time(run, repeats: int) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        run()
    return (time.perf_counter() - start) / repeats * 1e3


def _block_runs(blocks, xs, xh):
    layer, head = blocks
    return (lambda: [w.linear(x) for w, x in zip(layer, xs, strict=True)],
            lambda: head.linear(xh))  # fmt: skip


def _dense_runs(weights, xs, xh):
    layer, head = weights
    xb, xhb = [x.bfloat16() for x in xs], xh.bfloat16()
    linear = torch.nn.functional.linear
    return (lambda: [linear(x, w) for w, x in zip(layer, xb, strict=True)],
            lambda: linear(xhb, head))  # fmt: skip


def main() -> None:
    torch.set_num_threads(2)
    kernels = {"amx": QuantMatmulKernel.load(None), "vnni": QuantMatmulKernel.load(NO_AMX)}
    assert kernels["amx"] is not None and kernels["amx"].uses_amx, "needs an AMX CPU"
    torch.manual_seed(0)
    dense = [torch.randn(n, k) * 0.05 for n, k in PROJECTIONS]
    head = torch.randn(*HEAD) * 0.05
    blocks = {
        name: ([BlockInt4.from_dense(w, kernel) for w in dense],
               BlockInt8.from_dense(head, kernel, precise=True))
        for name, kernel in kernels.items()
    }  # fmt: skip
    bf16 = ([w.bfloat16() for w in dense], head.bfloat16())
    results = []
    for rows in ROWS:
        xs = [torch.randn(rows, k) for _, k in PROJECTIONS]
        xh = torch.randn(rows, HEAD[1])
        runs = {name: _block_runs(b, xs, xh) for name, b in blocks.items()}
        runs["bf16"] = _dense_runs(bf16, xs, xh)
        times: dict[str, dict[str, list[float]]] = {n: {"layer": [], "head": []} for n in runs}
        for _ in range(ROUNDS):
            for name, (layer, lm_head) in runs.items():
                times[name]["layer"].append(_time(layer, 20))
                times[name]["head"].append(_time(lm_head, 5))
        row = {"rows": rows}
        for name, parts in times.items():
            for part, values in parts.items():
                row[f"{name}_{part}_ms"] = statistics.median(values)
        results.append(row)
        print(row, flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=OUT).stdout.strip()  # fmt: skip
    report = {"cpu_flags": cpu_flags(), "threads": 2, "rounds": ROUNDS, "commit": commit,
              "results": results}  # fmt: skip
    (OUT / "amx-tiles.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        "# AMX tiles against AVX-512 VNNI for the block matmul",
        "",
        f"Command: `.venv/bin/python benchmarks/scripts/amx_tiles.py` at commit {commit}, "
        f"2 threads, median of {ROUNDS} interleaved rounds. CPU flags: {' '.join(cpu_flags())}.",
        "",
        "One layer's projections of the default model as Q4 blocks (qkv 960x576, o 576x576, "
        "gate_up 3072x576, down 576x1536) and its 49152x576 LM head as precise Q8 blocks; "
        "`amx`: the kernel's AMX tile path (rows >= 4), `vnni`: the same kernel built without "
        "AMX, `bf16`: PyTorch's dense bf16 linear (oneDNN).",
        "",
        "| rows | layer amx (ms) | layer vnni (ms) | layer bf16 (ms) | amx / vnni | "
        "head amx (ms) | head vnni (ms) | head bf16 (ms) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r['rows']} | {r['amx_layer_ms']:.3f} | {r['vnni_layer_ms']:.3f} | "
            f"{r['bf16_layer_ms']:.3f} | {r['amx_layer_ms'] / r['vnni_layer_ms']:.2f}x | "
            f"{r['amx_head_ms']:.2f} | {r['vnni_head_ms']:.2f} | {r['bf16_head_ms']:.2f} |"
        )
    (OUT / "amx-tiles.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
