"""Prefill, this tree's native step against a git revision's, side by side in one process:
one engine per model whose native step library alternates between the two builds, round by
round. Two prompts sets (random token ids, one output token, prefix caching off): one prompt
of 730 tokens (the serving sweeps' chat prompt; its first token at c=1) and four of 512.
Models: the default GGUF file and, where given, a bf16 Hugging Face directory (the one
`vllm_cpu_setup.sh` makes from that file: its dense tiles).

Each cell is the median over the rounds of the wall time, with the step's own matmul and
attention seconds beside it. Writes benchmarks/<dir>/<name>.{md,json} (name: prefill-ab).

Run: .venv/bin/python benchmarks/scripts/prefill_ab.py REV [--bf16-dir DIR] [--out-dir D]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from results import command_line, write_results
from revision_build import ROOT, step_libraries

from forklift import LLM, SamplingParams
from forklift.bench.report import cpu_flags
from forklift.checkpoint.source import default_model_path
from forklift.native.decode_step import NativeDecodeStep

ROUNDS = 6
PROMPT_SETS = {"1 x 730 tokens": (1, 730), "4 x 512 tokens": (4, 512)}


def measure_model(model: str, steps: dict[str, NativeDecodeStep], rounds: int) -> list[dict]:
    """Per prompt set and build: medians of (seconds, matmul s, attention s) over `rounds`."""
    llm = LLM(model=model, max_model_len=2048, enable_prefix_caching=False)
    rng = np.random.default_rng(0)
    prompts = {
        name: [{"prompt_token_ids": rng.integers(100, 40000, length).tolist()}
               for _ in range(count)]
        for name, (count, length) in PROMPT_SETS.items()
    }  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=1)
    runner = llm.llm_engine.runner
    seen: dict[tuple[str, str], list[tuple[float, float, float]]] = {
        (name, build): [] for name in prompts for build in steps
    }
    for round_index in range(rounds + 1):  # round 0 warms both builds up
        order = list(steps) if round_index % 2 == 0 else list(steps)[::-1]
        for build in order:
            step = runner.native_step = steps[build]
            for name, batch in prompts.items():
                step.start_timing()
                start = time.perf_counter()
                llm.generate(batch, params, use_tqdm=False)
                seconds = time.perf_counter() - start
                timing = step.stop_timing()
                if round_index:
                    seen[(name, build)].append((seconds, timing.matrix, timing.attention))
    del llm
    return [
        {
            "prompts": name,
            **{
                build: {
                    key: statistics.median(v[i] for v in seen[(name, build)])
                    for i, key in enumerate(("seconds", "matrix_s", "attention_s"))
                }
                | {"rounds": seen[(name, build)]}
                for build in steps
            },
        }
        for name in prompts
    ]


def round_speedup(row: dict, revision: str) -> float:
    """The median over rounds of the baseline's wall time over this tree's, round by round."""
    old, new = row[revision]["rounds"], row["this tree"]["rounds"]
    return statistics.median(a[0] / b[0] for a, b in zip(old, new, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("revision")
    parser.add_argument("--bf16-dir", type=Path, help="a bf16 Hugging Face directory")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks")
    parser.add_argument("--name", default="prefill-ab")
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    args = parser.parse_args()
    args.out_dir = args.out_dir.resolve()
    revision = args.revision
    models = {"GGUF Q4_1": str(default_model_path())}
    if args.bf16_dir is not None:
        models["bf16 directory"] = str(args.bf16_dir)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        libraries = step_libraries(revision, Path(scratch))
        for label, model in models.items():
            steps = {name: NativeDecodeStep(library) for name, library in libraries.items()}
            for row in measure_model(model, steps, args.rounds):
                rows.append({"model": label, **row})
                print(rows[-1]["model"], rows[-1]["prompts"], flush=True)
    report = {"cpu_flags": cpu_flags(), "baseline": revision, "rounds": args.rounds, "rows": rows}

    def ms(value: float) -> str:
        return f"{value * 1e3:.1f}"

    lines = [
        "# Prefill: this tree against a baseline revision",
        "",
        f"One engine per model whose native step library alternates between the two builds, "
        f"{args.rounds} rounds after a warm-up; medians in ms, one output token, prefix caching "
        "off. Matmuls and attention by the step's own timers; the last column is the median "
        "of each round's own speed-up (the machine's speed drifts from round to round).",
        "",
        f"| model | prompts | {revision} | this tree | speed-up | matmuls {revision} | "
        f"matmuls this tree | matmul speed-up | attention {revision} | attention this tree | "
        "round speed-up |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        old, new = r[revision], r["this tree"]
        lines.append(
            f"| {r['model']} | {r['prompts']} | {ms(old['seconds'])} | {ms(new['seconds'])} | "
            f"{old['seconds'] / new['seconds']:.2f}x | {ms(old['matrix_s'])} | "
            f"{ms(new['matrix_s'])} | {old['matrix_s'] / new['matrix_s']:.2f}x | "
            f"{ms(old['attention_s'])} | {ms(new['attention_s'])} | "
            f"{round_speedup(r, revision):.2f}x |"
        )
    lines.append("")
    extra: list[object] = ["--out-dir", args.out_dir]
    if args.bf16_dir is not None:
        extra = ["--bf16-dir", "$SMOLLM2_HF", *extra]
    if args.name != "prefill-ab":
        extra += ["--name", args.name]
    if args.rounds != ROUNDS:
        extra += ["--rounds", args.rounds]
    write_results(args.out_dir, args.name, report, lines,
                  command_line(__file__, revision, *extra))  # fmt: skip


if __name__ == "__main__":
    main()
