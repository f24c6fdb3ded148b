"""Prefill and decode with the down projection's activations precise against int8, one
process, two engines on the default model's file alternating round by round (the same
kernels; only the down projections' activation rows differ: two int8 rows a row, or one).

    .venv/bin/python benchmarks/scripts/down_activations_speed.py --out benchmarks/avx2
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
from down_activations_quality import down_activations
from results import command_line, write_results
from revision_build import ROOT

from forklift import LLM, SamplingParams
from forklift.bench.report import cpu_flags

ROUNDS = 5
# (name, prompts, prompt tokens, output tokens): prefill alone, then decode-heavy batches
WORKLOADS = [
    ("prefill 1 x 730", 1, 730, 1),
    ("prefill 4 x 512", 4, 512, 1),
    ("decode 1 x 128 after 564", 1, 564, 129),
    ("decode 8 x 128 after 564", 8, 564, 129),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks")
    args = parser.parse_args()
    args.out = args.out.resolve()
    engines = {}
    for label, precise in (("precise", True), ("int8", False)):
        with down_activations(precise):
            engines[label] = LLM(max_model_len=2048, enable_prefix_caching=False)
    rng = np.random.default_rng(0)
    seen: dict[tuple[str, str], list[float]] = {(w[0], e): [] for w in WORKLOADS for e in engines}
    for round_index in range(ROUNDS + 1):  # round 0 warms both up
        order = list(engines) if round_index % 2 == 0 else list(engines)[::-1]
        for name, count, length, output in WORKLOADS:
            prompts = [{"prompt_token_ids": rng.integers(100, 40000, length).tolist()}
                       for _ in range(count)]  # fmt: skip
            params = SamplingParams(temperature=0, max_tokens=output, ignore_eos=True)
            for label in order:
                start = time.perf_counter()
                engines[label].generate(prompts, params, use_tqdm=False)
                if round_index:
                    seen[(name, label)].append(time.perf_counter() - start)
    rows = []
    for name, _, _, _ in WORKLOADS:
        precise, coarse = (statistics.median(seen[(name, e)]) for e in engines)
        rows.append({"workload": name, "precise_s": precise, "int8_s": coarse,
                     "speedup": precise / coarse,
                     "rounds": {e: seen[(name, e)] for e in engines}})  # fmt: skip
        print(rows[-1]["workload"], f"{rows[-1]['speedup']:.2f}x", flush=True)
    lines = [
        "# The down projection's activations: precise against int8, speed",
        "",
        f"Default model (GGUF Q4_1), two engines in one process alternating over {ROUNDS} "
        "rounds after a warm-up; medians of wall time per `generate` call, random prompt "
        "ids, prefix caching off. Decode rows include their prompt's prefill.",
        "",
        "| workload | precise (ms) | int8 (ms) | speed-up |",
        "|---|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['workload']} | {r['precise_s'] * 1e3:.1f} | "
                     f"{r['int8_s'] * 1e3:.1f} | {r['speedup']:.2f}x |")  # fmt: skip
    lines.append("")
    report = {"rows": rows, "rounds": ROUNDS, "cpu_flags": cpu_flags()}
    write_results(args.out, "down-activations-speed", report, lines,
                  command_line(__file__, "--out", args.out))  # fmt: skip


if __name__ == "__main__":
    main()
