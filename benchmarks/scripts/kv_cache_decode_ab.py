"""Decode steps on one KV cache dtype against another (by default int8 against the cache in
the model's dtype), the two engines alternating round by round in one process (this kind
of machine drifts by 10-25% within minutes, so sequential runs of one engine then the other
mislead): the default model, pure decode steps of `batch` requests at a depth of `context`
prompt tokens.

    .venv/bin/python benchmarks/scripts/kv_cache_decode_ab.py [out_dir]
        [--base auto --candidate int8] [--points 128x1,128x8,2048x1,2048x8] [--rounds 5]
        [--name kv-cache-int8-decode]
"""

from __future__ import annotations

import argparse
import random
import statistics
from pathlib import Path

from results import command_line, write_results
from revision_build import ROOT

from forklift import LLM
from forklift.bench.decode import time_pure_decode
from forklift.bench.report import cpu_flags

POINTS = "128x1,128x8,2048x1,2048x8"
ROUNDS, STEPS = 5, 32


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", nargs="?", type=Path, default=ROOT / "benchmarks")
    parser.add_argument("--base", default="auto")
    parser.add_argument("--candidate", default="int8")
    parser.add_argument("--points", default=POINTS, help="depth x batch, comma-separated")
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--name", default="kv-cache-int8-decode")
    args = parser.parse_args()
    out_dir = args.out_dir.resolve()
    points = [tuple(int(n) for n in p.split("x")) for p in args.points.split(",")]
    longest = max(context for context, _ in points)
    llms = {
        role: LLM(
            kv_cache_dtype=cache,
            max_model_len=longest + 2 * STEPS + 64,
            kv_cache_memory_bytes=1 << 30,
            enable_prefix_caching=False,
        )  # fmt: skip
        for role, cache in (("base", args.base), ("candidate", args.candidate))
    }
    name = {role: llm.llm_engine.runner.kv_format.name for role, llm in llms.items()}
    base, candidate = name["base"], name["candidate"]
    rows, report_points = [], []
    for context, batch in points:
        medians: dict[str, list[float]] = {role: [] for role in llms}
        for round_index in range(args.rounds):
            for role, llm in llms.items():
                times = time_pure_decode(llm, batch, context, STEPS, random.Random(round_index))
                medians[role].append(1000 * statistics.median(times))
        step = {role: statistics.median(values) for role, values in medians.items()}
        report_points.append({"context": context, "batch": batch, "step_ms": step,
                              "rounds_ms": medians})  # fmt: skip
        rows.append(
            f"| {context} | {batch} | {step['base']:.2f} | {step['candidate']:.2f} | "
            f"{step['base'] / step['candidate']:.2f}x |"
        )
    batch_cost = {}
    for context in sorted({c for c, _ in points}):
        by_batch = {p["batch"]: p["step_ms"] for p in report_points if p["context"] == context}
        if 1 in by_batch and 8 in by_batch:
            batch_cost[context] = {role: by_batch[8][role] / by_batch[1][role] for role in llms}
    lines = [
        f"# Decode steps: {candidate} KV cache against {base}, alternating rounds",
        "",
        f"Default model (GGUF Q4_1, native step, computing in "
        f"{str(llms['base'].llm_engine.runner.dtype).removeprefix('torch.')}), {base} cache "
        f"against {candidate}; each cell the median over {args.rounds} alternating rounds of "
        f"the median of {STEPS} pure decode steps.",
        "",
        f"| depth | batch | {base} step (ms) | {candidate} step (ms) | {candidate} speed-up |",
        "|---|---|---|---|---|",
        *rows,
        "",
    ]
    if batch_cost:
        lines += [
            "A batch-8 step over a batch-1 step: "
            + "; ".join(
                f"depth {c}: {v['base']:.2f}x ({base}), {v['candidate']:.2f}x ({candidate})"
                for c, v in batch_cost.items()
            ),
            "",
        ]
    report = {"base": base, "candidate": candidate, "points": report_points,
              "batch_cost": batch_cost, "cpu_flags": cpu_flags()}  # fmt: skip
    arguments = [out_dir, "--base", args.base, "--candidate", args.candidate,
                 "--points", args.points, "--rounds", args.rounds, "--name", args.name]  # fmt: skip
    write_results(out_dir, args.name, report, lines, command_line(__file__, *arguments))


if __name__ == "__main__":
    main()
