"""The native decode step of this tree against the one of a git revision, side by side in one
process: one engine on the default model (bf16, its GGUF blocks), its step library swapped
between the two builds, rounds alternating, each round `STEPS` pure decode steps at each
batch size with 564-token prompts (or --context, at --batches), the model in bf16 (or
--dtype: `auto` is the CPU's default, fp32 without AVX512-BF16). Writes
benchmarks/<dir>/<name>.{md,json} (name: decode-step-ab unless given).

Run: .venv/bin/python benchmarks/scripts/decode_step_ab.py REV [out_dir [name]]
     [--context N] [--batches 1,8] [--dtype auto] [--model GGUF]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
from pathlib import Path

from results import command_line, write_results
from revision_build import ROOT, step_libraries

from forklift.bench.decode import decode_step_budget, prefill_steps, time_pure_decode
from forklift.bench.report import cpu_flags
from forklift.checkpoint.source import default_model_path
from forklift.llm import LLM
from forklift.native.decode_step import NativeDecodeStep

CONTEXT, STEPS, ROUNDS = 564, 8, 6
BATCHES = (1, 8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("revision")
    parser.add_argument("out_dir", nargs="?", type=Path, default=ROOT / "benchmarks")
    parser.add_argument("name", nargs="?", default="decode-step-ab")
    parser.add_argument("--context", type=int, default=CONTEXT)
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)))
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "auto"))
    parser.add_argument("--model", type=Path, default=None, help="a GGUF file (default model)")
    args = parser.parse_args()
    revision, out_dir, stem, context = (
        args.revision,
        args.out_dir.resolve(),
        args.name,
        args.context,
    )
    batches = tuple(int(b) for b in args.batches.split(","))
    longest = max(batches)
    budget = decode_step_budget(longest)
    model = args.model or default_model_path()
    llm = LLM(model=str(model), dtype=args.dtype, max_num_seqs=longest,
              max_model_len=context + STEPS + 16 + prefill_steps(longest, context, budget),
              max_num_batched_tokens=budget)  # fmt: skip
    runner = llm.llm_engine.runner
    assert runner.native_step is not None, "the native step does not run here"
    with tempfile.TemporaryDirectory() as scratch:
        libraries = step_libraries(revision, Path(scratch))
        steps = {name: NativeDecodeStep(library) for name, library in libraries.items()}
        rows = []
        for batch in batches:
            times: dict[str, list[float]] = {name: [] for name in steps}
            for round_index in range(ROUNDS):
                for name, step in steps.items():
                    runner.native_step = step
                    rng = random.Random(round_index)
                    times[name] += time_pure_decode(llm, batch, context, STEPS, rng)
            ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
            rows.append({"batch": batch, "ms": ms, "speedup": ms[revision] / ms["this tree"]})
            print(rows[-1], flush=True)
    dtype = {"bfloat16": "bf16", "float32": "fp32"}.get(str(runner.dtype).removeprefix("torch."))
    report = {"cpu_flags": cpu_flags(), "baseline": revision, "model": model.name,
              "context": context, "dtype": dtype,
              "steps": STEPS, "rounds": ROUNDS, "rows": rows}  # fmt: skip
    lines = [
        "# Native decode step: this tree against a baseline revision",
        "",
        f"{'Default model' if args.model is None else model.name} ({dtype}, its GGUF blocks), "
        f"{context}-token prompts, one engine whose step "
        f"library alternates between the two builds: median of {ROUNDS} rounds x {STEPS} pure "
        "decode steps each.",
        "",
        f"| batch | {revision} (ms) | this tree (ms) | speed-up |",
        "|---:|---:|---:|---:|",
        *(
            f"| {r['batch']} | {r['ms'][revision]:.2f} | {r['ms']['this tree']:.2f} | "
            f"{r['speedup']:.2f}x |"
            for r in rows
        ),
        "",
    ]
    extra = [] if stem == "decode-step-ab" else [stem]
    if context != CONTEXT or batches != BATCHES:
        extra += ["--context", context, "--batches", args.batches]
    if args.dtype != "bfloat16":
        extra += ["--dtype", args.dtype]
    if args.model is not None:
        extra += ["--model", "$GEMMA" if "gemma" in model.name else model.name]
    write_results(out_dir, stem, report, lines, command_line(__file__, revision, out_dir, *extra))


if __name__ == "__main__":
    main()
