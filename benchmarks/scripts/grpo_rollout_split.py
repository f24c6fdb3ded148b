"""Where a GRPO rollout's time goes: `forklift bench grpo`'s rollouts (8 prompts x 8 samples,
up to 64 tokens, temperature 1, the default model dense in bf16) on two engines side by side
in one process, the native decode step on AMX tiles and the PyTorch layers, rounds
alternating. For the native engine the step's own timers split its calls into tile matmuls,
attention and the rest of the step; what is left of a rollout is prefill, sampling and the
host. Writes benchmarks/<dir>/grpo-rollout-split.{md,json}.

Run: .venv/bin/python benchmarks/scripts/grpo_rollout_split.py [out_dir]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

from results import command_line, write_results
from revision_build import ROOT

from forklift import LLM
from forklift.bench.report import cpu_flags
from forklift.checkpoint.source import default_model_path
from forklift.rl.rollouts import forklift_rollouts
from forklift.rl.tasks import get_task

PROMPTS, SAMPLES, TOKENS, ROUNDS = 8, 8, 64, 6


def _engine(decode_backend: str) -> LLM:
    return LLM(model=str(default_model_path()), dtype="bfloat16", quantization="none",
               max_model_len=512, gpu_memory_utilization=0.35,
               decode_backend=decode_backend)  # fmt: skip


def main() -> None:
    out_dir = Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else ROOT / "benchmarks"
    engines = {"native step": _engine("auto"), "PyTorch layers": _engine("torch")}
    assert engines["native step"].llm_engine.runner.native_step is not None, "no AMX tiles here"
    tokenizer = engines["native step"].llm_engine.tokenizer
    task = get_task("arithmetic")
    seconds: dict[str, list[float]] = {name: [] for name in engines}
    parts: dict[str, list[float]] = {"matrix": [], "attention": [], "other": []}
    for round_index in range(ROUNDS + 1):  # round 0 warms both engines up
        prompts = [tokenizer.encode_chat([{"role": "user", "content": p.question}])
                   for p in task.problems(PROMPTS, round_index)]  # fmt: skip
        for name, llm in engines.items():
            step = llm.llm_engine.runner.native_step
            if step is not None:
                step.start_timing()
            started = time.perf_counter()
            forklift_rollouts(llm, prompts, SAMPLES, 1.0, TOKENS, round_index)
            elapsed = time.perf_counter() - started
            timings = step.stop_timing() if step is not None else None
            if round_index == 0:
                continue
            seconds[name].append(elapsed)
            if timings is not None:
                for part in parts:
                    parts[part].append(getattr(timings, part))
    median = {name: statistics.median(t) for name, t in seconds.items()}
    split = {part: statistics.median(t) for part, t in parts.items()}
    split["rest (prefill, sampling, host)"] = median["native step"] - sum(split.values())
    report = {"cpu_flags": cpu_flags(), "rounds": ROUNDS, "rollout_s": median, "split_s": split}
    speedup = median["PyTorch layers"] / median["native step"]
    lines = [
        "# GRPO rollouts: the native step on AMX tiles against the PyTorch layers",
        "",
        f"`forklift bench grpo`'s rollouts ({PROMPTS} prompts x {SAMPLES} samples, up to "
        f"{TOKENS} tokens, temperature 1, the default model dense in bf16) on two engines in "
        f"one process, rounds alternating; median of {ROUNDS} rounds after a warm-up round.",
        "",
        "| decode steps | rollout (s) |",
        "|---|---:|",
        *(f"| {name} | {s:.2f} |" for name, s in median.items()),
        "",
        f"The native step: **{speedup:.2f}x** the PyTorch layers' rollouts. Its rollout, split "
        "by the step's own timers:",
        "",
        "| part | seconds |",
        "|---|---:|",
        *(f"| {part} | {s:.2f} |" for part, s in split.items()),
        "",
    ]
    write_results(out_dir, "grpo-rollout-split", report, lines, command_line(__file__, out_dir))


if __name__ == "__main__":
    main()
