"""Decode steps with the sampling batch reused between steps (SamplingBatchReuse) against
built anew every step (SamplingBatch.from_rows), side by side in one process: one engine on
the default model, rounds alternating, each round 8 pure decode steps at each batch size with
564-token prompts. Writes benchmarks/<dir>/sampling-batch-reuse.{md,json}.

Run: .venv/bin/python benchmarks/scripts/sampling_batch_reuse.py [out_dir]
"""

from __future__ import annotations

import random
import statistics
import sys
from pathlib import Path

import torch
from results import command_line, write_results
from revision_build import ROOT

from forklift.bench.decode import decode_step_budget, prefill_steps, time_pure_decode
from forklift.bench.report import cpu_flags
from forklift.checkpoint.source import default_model_path
from forklift.core.scheduler_output import SamplingRow
from forklift.llm import LLM
from forklift.sampling.batch_reuse import SamplingBatchReuse
from forklift.sampling.metadata import SamplingBatch

CONTEXT, STEPS, ROUNDS = 564, 8, 12
BATCHES = (1, 8)


class FreshBatches:
    """Every step's batch built anew (what the runner did before the reuse)."""

    def batch_for(
        self, rows: list[SamplingRow], device: torch.device, vocab_size: int
    ) -> SamplingBatch:
        return SamplingBatch.from_rows(rows, device, vocab_size)


def main() -> None:
    out_dir = Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else ROOT / "benchmarks"
    budget = decode_step_budget(max(BATCHES))
    llm = LLM(model=str(default_model_path()), dtype="bfloat16", max_num_seqs=max(BATCHES),
              max_model_len=CONTEXT + STEPS + 16 + prefill_steps(max(BATCHES), CONTEXT, budget),
              max_num_batched_tokens=budget)  # fmt: skip
    runner = llm.llm_engine.runner
    rows = []
    for batch in BATCHES:
        times: dict[str, list[float]] = {"built anew": [], "reused": []}
        for round_index in range(ROUNDS):
            for name in times:
                runner._sampling_batches = (
                    FreshBatches() if name == "built anew" else SamplingBatchReuse()
                )
                rng = random.Random(round_index)
                times[name] += time_pure_decode(llm, batch, CONTEXT, STEPS, rng)
        ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        rows.append({"batch": batch, "ms": ms, "speedup": ms["built anew"] / ms["reused"]})
        print(rows[-1], flush=True)
    report = {"cpu_flags": cpu_flags(), "context": CONTEXT, "steps": STEPS, "rounds": ROUNDS,
              "native_step": runner.native_step is not None, "rows": rows}  # fmt: skip
    lines = [
        "# Sampling batch reused between decode steps, against built anew each step",
        "",
        f"Default model (bf16, its GGUF blocks), {CONTEXT}-token prompts, one engine, the two "
        f"ways alternating: median of {ROUNDS} rounds x {STEPS} pure decode steps each.",
        "",
        "| batch | built anew (ms) | reused (ms) | speed-up |",
        "|---:|---:|---:|---:|",
        *(
            f"| {r['batch']} | {r['ms']['built anew']:.2f} | {r['ms']['reused']:.2f} | "
            f"{r['speedup']:.3f}x |"
            for r in rows
        ),
        "",
    ]
    write_results(out_dir, "sampling-batch-reuse", report, lines, command_line(__file__, out_dir))


if __name__ == "__main__":
    main()
