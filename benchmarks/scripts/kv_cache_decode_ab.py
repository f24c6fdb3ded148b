"""Decode steps on the int8 KV cache against the cache in the model's dtype, the two engines
alternating round by round in one process (this kind of machine drifts by 10-25% within
minutes, so sequential runs of one engine then the other mislead): the default model,
pure decode steps of `batch` requests at a depth of `context` prompt tokens.

    .venv/bin/python benchmarks/scripts/kv_cache_decode_ab.py [out_dir]
"""

from __future__ import annotations

import random
import statistics
import sys
from pathlib import Path

from results import command_line, write_results
from revision_build import ROOT

from forklift import LLM
from forklift.bench.decode import time_pure_decode
from forklift.bench.report import cpu_flags

POINTS = ((128, 1), (128, 8), (2048, 1), (2048, 8))
ROUNDS, STEPS = 5, 32
CACHES = ("auto", "int8")


def main() -> None:
    out_dir = Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else ROOT / "benchmarks"
    longest = max(context for context, _ in POINTS)
    llms = {
        cache: LLM(
            kv_cache_dtype=cache,
            max_model_len=longest + 2 * STEPS + 64,
            kv_cache_memory_bytes=1 << 30,
            enable_prefix_caching=False,
        )  # fmt: skip
        for cache in CACHES
    }
    dtype = llms["auto"].llm_engine.runner.kv_format.name
    rows, report_points = [], []
    for context, batch in POINTS:
        medians: dict[str, list[float]] = {cache: [] for cache in CACHES}
        for round_index in range(ROUNDS):
            for cache, llm in llms.items():
                times = time_pure_decode(llm, batch, context, STEPS, random.Random(round_index))
                medians[cache].append(1000 * statistics.median(times))
        step = {cache: statistics.median(values) for cache, values in medians.items()}
        report_points.append({"context": context, "batch": batch, "step_ms": step,
                              "rounds_ms": medians})  # fmt: skip
        rows.append(
            f"| {context} | {batch} | {step['auto']:.2f} | {step['int8']:.2f} | "
            f"{step['auto'] / step['int8']:.2f}x |"
        )
    batch_cost = {}
    for context in sorted({c for c, _ in POINTS}):
        by_batch = {p["batch"]: p["step_ms"] for p in report_points if p["context"] == context}
        batch_cost[context] = {cache: by_batch[8][cache] / by_batch[1][cache] for cache in CACHES}
    lines = [
        "# Decode steps: int8 KV cache against the model-dtype cache, alternating rounds",
        "",
        f"Default model (GGUF Q4_1, native step), {dtype} cache against int8; each cell the "
        f"median over {ROUNDS} alternating rounds of the median of {STEPS} pure decode steps.",
        "",
        f"| depth | batch | {dtype} step (ms) | int8 step (ms) | int8 speed-up |",
        "|---|---|---|---|---|",
        *rows,
        "",
        "A batch-8 step over a batch-1 step: "
        + "; ".join(
            f"depth {c}: {v['auto']:.2f}x ({dtype}), {v['int8']:.2f}x (int8)"
            for c, v in batch_cost.items()
        ),
        "",
    ]
    report = {"cache_dtype": dtype, "points": report_points, "batch_cost": batch_cost,
              "cpu_flags": cpu_flags()}  # fmt: skip
    arguments = [out_dir] if len(sys.argv) > 1 else []
    write_results(out_dir, "kv-cache-int8-decode", report, lines,
                  command_line(__file__, *arguments))  # fmt: skip


if __name__ == "__main__":
    main()
