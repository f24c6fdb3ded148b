"""The native libraries built with the compiler's own loops at 256-bit vectors (GCC's tuning
for recent AVX-512 CPUs) against 512-bit ones (`-mprefer-vector-width=512`, what
forklift.cpu.native_arch_flags asks for there), side by side in one process: the decode
step on the default model (bf16, its GGUF blocks; 564-token prompts, batch 1 and 8) and the
sampler's last stage on 64 rows of the default vocabulary with logprobs, as an RL rollout
runs it. Rounds alternate between the builds. Writes benchmarks/<dir>/vector-width-ab.{md,json}.

Run: .venv/bin/python benchmarks/scripts/vector_width_ab.py [out_dir]
"""

from __future__ import annotations

import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from results import command_line, write_results
from revision_build import CSRC, ROOT, build_library

from forklift.bench.decode import time_pure_decode
from forklift.bench.report import cpu_flags
from forklift.checkpoint.source import default_model_path
from forklift.llm import LLM
from forklift.native.decode_step import NativeDecodeStep
from forklift.native.seeded_sample import NativeSeededSampler

CONTEXT, STEPS, ROUNDS, SAMPLER_ROWS = 564, 8, 6, 64
WIDTHS = {
    "256-bit": ("-march=native", "-mprefer-vector-width=256"),
    "512-bit": ("-march=native", "-mprefer-vector-width=512"),
}


def _sampler_ms(sampler: NativeSeededSampler, logits: torch.Tensor) -> float:
    rows = logits.shape[0]
    temperature, seeds = torch.ones(rows), torch.arange(rows)
    steps = torch.zeros(rows, dtype=torch.int64)
    best = float("inf")
    for _ in range(10):
        started = time.perf_counter()
        sampler(logits, temperature, seeds, steps, True)
        best = min(best, time.perf_counter() - started)
    return best * 1e3


def main() -> None:
    out_dir = Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else ROOT / "benchmarks"
    assert "avx512f" in cpu_flags(), "a comparison for AVX-512 CPUs"
    llm = LLM(model=str(default_model_path()), dtype="bfloat16", max_num_seqs=8,
              max_model_len=CONTEXT + STEPS + 64, max_num_batched_tokens=2048)  # fmt: skip
    runner = llm.llm_engine.runner
    assert runner.native_step is not None, "the native step does not run here"
    vocab = llm.llm_engine.model_config.vocab_size
    logits = torch.randn(SAMPLER_ROWS, vocab, generator=torch.Generator().manual_seed(0)) * 3
    with tempfile.TemporaryDirectory() as scratch:
        steps, samplers = {}, {}
        for name, arch in WIDTHS.items():
            tag = name.split("-")[0]
            steps[name] = NativeDecodeStep(
                build_library(ROOT / CSRC, "decode_step", Path(scratch) / f"step{tag}.so", arch)
            )
            samplers[name] = NativeSeededSampler(
                build_library(ROOT / CSRC, "seeded_sample", Path(scratch) / f"sample{tag}.so", arch)
            )
        times: dict[str, dict[str, list[float]]] = {
            part: {name: [] for name in WIDTHS} for part in ("batch 1", "batch 8", "sampler")
        }
        for round_index in range(ROUNDS):
            for name in WIDTHS:
                runner.native_step = steps[name]
                for batch in (1, 8):
                    rng = random.Random(round_index)
                    step_s = time_pure_decode(llm, batch, CONTEXT, STEPS, rng)
                    times[f"batch {batch}"][name] += [s * 1e3 for s in step_s]
                times["sampler"][name].append(_sampler_ms(samplers[name], logits))
    ms = {
        part: {name: statistics.median(t) for name, t in by.items()} for part, by in times.items()
    }
    report = {"cpu_flags": cpu_flags(), "rounds": ROUNDS, "ms": ms}
    lines = [
        "# Native libraries: the compiler's loops at 256-bit against 512-bit vectors",
        "",
        f"One process, rounds alternating ({ROUNDS}): the native decode step (default model, "
        f"bf16 with its GGUF blocks, {CONTEXT}-token prompts; median of {STEPS} pure decode "
        f"steps a round) and the sampler's last stage ({SAMPLER_ROWS} rows x {vocab} logits, "
        "temperature 1, with logprobs; best of 10 calls a round, median over rounds). The "
        "kernels written with intrinsics are the same in both builds; what differs is the "
        "loops the compiler vectorises itself (norms, rotary, gates, rounding, the sampler).",
        "",
        "| part | 256-bit (ms) | 512-bit (ms) | speed-up |",
        "|---|---:|---:|---:|",
        *(
            f"| {part} | {by['256-bit']:.2f} | {by['512-bit']:.2f} | "
            f"{by['256-bit'] / by['512-bit']:.2f}x |"
            for part, by in ms.items()
        ),
        "",
    ]
    write_results(out_dir, "vector-width-ab", report, lines, command_line(__file__, out_dir))


if __name__ == "__main__":
    main()
