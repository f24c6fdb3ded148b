"""The native decode-attention kernel of this tree against the one of a git revision, side
by side in one process: the default model's shapes (9 query heads on 3 KV heads of 64, bf16
cache, 16-token blocks), every sequence at the same depth, the two kernels alternating. Two
cache states: "cold", 30 layers' caches so no layer's K/V stay in cache (as in a decode
step), and "hot", the first layer's cache read 30 times (the kernel's own speed). Writes
benchmarks/<dir>/attention-kernel.{md,json}.

Run: .venv/bin/python benchmarks/scripts/attention_kernel.py REV [out_dir]
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch
from results import command_line, write_results
from revision_build import CSRC, ROOT, build_library, checkout_sources

from forklift.bench.report import cpu_flags
from forklift.native.decode_attention_kernel import NativeDecodeAttention

LAYERS, KV_HEADS, GROUP, HEAD_DIM, BLOCK, DEPTH = 30, 3, 3, 64, 16, 564
BATCHES = (1, 8)
REPEATS = 30


def case(batch: int) -> tuple:
    blocks_per_seq = -(-DEPTH // BLOCK)
    num_blocks = batch * blocks_per_seq + 1
    gen = torch.Generator().manual_seed(batch)
    caches = [
        tuple(torch.randn(KV_HEADS, num_blocks, BLOCK, HEAD_DIM, generator=gen).bfloat16()
              for _ in range(2))
        for _ in range(LAYERS)
    ]  # fmt: skip
    order = torch.randperm(num_blocks - 1, generator=gen) + 1
    tables = order[: batch * blocks_per_seq].view(batch, blocks_per_seq)
    positions = torch.arange(blocks_per_seq * BLOCK)
    bias = torch.where(positions < DEPTH, 0.0, float("-inf")).expand(batch, -1).contiguous()
    q = torch.randn(batch, KV_HEADS * GROUP, HEAD_DIM, generator=gen).bfloat16()
    return caches, tables, bias, q


def step(kernel: NativeDecodeAttention, caches, tables, bias, q) -> float:
    started = time.perf_counter()
    for keys, values in caches:
        kernel(q, keys, values, tables, bias, HEAD_DIM**-0.5)
    return time.perf_counter() - started


def main() -> None:
    revision = sys.argv[1]
    out_dir = Path(sys.argv[2]).resolve() if len(sys.argv) > 2 else ROOT / "benchmarks"
    with tempfile.TemporaryDirectory() as scratch:
        base_dir = checkout_sources(revision, Path(scratch) / "base")
        kernels = {
            revision: NativeDecodeAttention(
                build_library(base_dir, "decode_attention", Path(scratch) / "base.so")
            ),
            "this tree": NativeDecodeAttention(
                build_library(ROOT / CSRC, "decode_attention", Path(scratch) / "tree.so")
            ),
        }
        rows = []
        for batch, state in ((b, s) for b in BATCHES for s in ("cold", "hot")):
            inputs = case(batch)
            if state == "hot":
                inputs = ([inputs[0][0]] * LAYERS, *inputs[1:])
            outputs = {name: k(inputs[3], *inputs[0][0], inputs[1], inputs[2], HEAD_DIM**-0.5)
                       for name, k in kernels.items()}  # fmt: skip
            first, second = outputs.values()
            error = (first.float() - second.float()).abs().max().item()
            times: dict[str, list[float]] = {name: [] for name in kernels}
            for _ in range(REPEATS):
                for name, kernel in kernels.items():
                    times[name].append(step(kernel, *inputs))
            best = {name: min(t) * 1e3 for name, t in times.items()}
            rows.append({"batch": batch, "cache": state, "ms": best, "max_abs_difference": error,
                         "speedup": best[revision] / best["this tree"]})  # fmt: skip
    report = {"cpu_flags": cpu_flags(), "baseline": revision, "layers": LAYERS,
              "depth": DEPTH, "rows": rows}  # fmt: skip
    lines = [
        "# Decode attention kernel: this tree against a baseline revision",
        "",
        f"{LAYERS} layers' attention at depth {DEPTH}, {KV_HEADS * GROUP} query heads on "
        f"{KV_HEADS} KV heads of {HEAD_DIM}, bf16 cache; best of {REPEATS} alternating runs, "
        f"{torch.get_num_threads()} threads.",
        "",
        f"| batch | cache | {revision} (ms) | this tree (ms) | speed-up | max abs difference |",
        "|---:|---|---:|---:|---:|---:|",
        *(
            f"| {r['batch']} | {r['cache']} | {r['ms'][revision]:.2f} | "
            f"{r['ms']['this tree']:.2f} | {r['speedup']:.2f}x | {r['max_abs_difference']:.2e} |"
            for r in rows
        ),  # fmt: skip
        "",
    ]
    write_results(
        out_dir, "attention-kernel", report, lines, command_line(__file__, revision, out_dir)
    )


if __name__ == "__main__":
    main()
