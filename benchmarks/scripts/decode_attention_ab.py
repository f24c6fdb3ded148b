"""Decode rows' attention, this tree against a git revision, side by side in one process: each
engine's native step library alternates between the two builds, round by round. Two
workloads where decode rows' attention weighs:

- `forklift bench grpo`'s rollouts: 8 prompts x 8 samples, up to 64 tokens, temperature 1,
  the default model dense in bf16 (the trainer's engine settings);
- 8 sequences decoding 64 tokens after 800-token prompts, the default model's GGUF file
  (the time of 65 tokens less the time of 1, per decode step).

Each cell is the median over the rounds, with the step's own attention seconds beside it.
Writes benchmarks/<dir>/<name>.{md,json} (name: decode-attention-ab unless given).

Run: .venv/bin/python benchmarks/scripts/decode_attention_ab.py REV [out_dir [name]]
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from results import command_line, write_results
from revision_build import ROOT, step_libraries

from forklift import LLM, SamplingParams
from forklift.bench.report import cpu_flags
from forklift.checkpoint.source import default_model_path
from forklift.native.decode_step import NativeDecodeStep
from forklift.rl.grpo import GRPOConfig
from forklift.rl.rollouts import forklift_rollouts
from forklift.rl.tasks import get_task

ROUNDS = 5
PROMPTS, SAMPLES, TOKENS = 8, 8, 64
SEQUENCES, PROMPT_TOKENS, DECODE_TOKENS = 8, 800, 64

# One measurement: (seconds, attention seconds) of a workload on an engine.
Measure = Callable[[LLM], tuple[float, float]]


def timed(llm: LLM, work: Callable[[], None]) -> tuple[float, float]:
    step = llm.llm_engine.runner.native_step
    step.start_timing()
    start = time.perf_counter()
    work()
    seconds = time.perf_counter() - start
    return seconds, step.stop_timing().attention


def rollout_engine() -> tuple[LLM, Measure]:
    config = GRPOConfig()
    llm = LLM(model=str(default_model_path()), dtype="bfloat16", quantization="none",
              max_model_len=config.max_model_len,
              gpu_memory_utilization=config.gpu_memory_utilization)  # fmt: skip
    tokenizer = llm.llm_engine.tokenizer
    problems = get_task(config.task).problems(PROMPTS, seed=0)
    prompts = [tokenizer.encode_chat([{"role": "user", "content": p.question}]) for p in problems]

    def measure(engine: LLM) -> tuple[float, float]:
        return timed(engine, lambda: forklift_rollouts(engine, prompts, SAMPLES, 1.0, TOKENS, 0))

    return llm, measure


def decode_engine() -> tuple[LLM, Measure]:
    llm = LLM(model=str(default_model_path()), enable_prefix_caching=False,
              max_model_len=PROMPT_TOKENS + DECODE_TOKENS + 16)  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 40000, (SEQUENCES, PROMPT_TOKENS), generator=generator)
    prompts = [{"prompt_token_ids": row.tolist()} for row in ids]

    def measure(engine: LLM) -> tuple[float, float]:
        spans = []
        for tokens in (1, DECODE_TOKENS + 1):
            params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
            spans.append(
                timed(engine, lambda p=params: engine.generate(prompts, p, use_tqdm=False))
            )
        (prefill_s, prefill_attention), (whole_s, whole_attention) = spans
        steps = DECODE_TOKENS
        return (whole_s - prefill_s) / steps, (whole_attention - prefill_attention) / steps

    return llm, measure


def compare(llm: LLM, measure: Measure, steps: dict[str, NativeDecodeStep]) -> dict:
    runner = llm.llm_engine.runner
    runner.native_step = next(iter(steps.values()))
    measure(llm)  # warm-up
    seen: dict[str, list[tuple[float, float]]] = {name: [] for name in steps}
    for round_index in range(ROUNDS):
        names = list(steps) if round_index % 2 == 0 else list(steps)[::-1]
        for name in names:
            runner.native_step = steps[name]
            seen[name].append(measure(llm))
    return {
        name: {
            "seconds": statistics.median(s for s, _ in values),
            "attention_s": statistics.median(a for _, a in values),
            "rounds": values,
        }
        for name, values in seen.items()
    }


def main() -> None:
    revision = sys.argv[1]
    out_dir = Path(sys.argv[2]).resolve() if len(sys.argv) > 2 else ROOT / "benchmarks"
    stem = sys.argv[3] if len(sys.argv) > 3 else "decode-attention-ab"
    workloads = {
        f"RL rollout ({PROMPTS} x {SAMPLES} x {TOKENS}, bf16), s": rollout_engine,
        f"{SEQUENCES} sequences after {PROMPT_TOKENS} tokens (GGUF), a step": decode_engine,
    }
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        libraries = step_libraries(revision, Path(scratch))
        for label, make in workloads.items():
            llm, measure = make()
            if llm.llm_engine.runner.native_step is None:
                # (dense bf16 without AMX tiles: this engine's steps are not native here)
                print(label, "skipped: no native step for it on this CPU")
                del llm
                continue
            steps = {name: NativeDecodeStep(library) for name, library in libraries.items()}
            result = compare(llm, measure, steps)
            rows.append({"workload": label, **result})
            print(label, {k: (v["seconds"], v["attention_s"]) for k, v in result.items()})
            del llm
    report = {"cpu_flags": cpu_flags(), "baseline": revision, "rounds": ROUNDS, "rows": rows}

    def ratio(row: dict, key: str) -> float:
        return row[revision][key] / row["this tree"][key]

    def figure(value: float) -> str:
        return f"{value * 1e3:.2f} ms" if value < 0.1 else f"{value:.3f} s"

    lines = [
        "# Decode rows' attention: this tree against a baseline revision",
        "",
        f"Each workload on one engine whose native step library alternates between the two "
        f"builds, {ROUNDS} rounds after a warm-up; medians, with the step's own attention "
        "time beside each.",
        "",
        f"| workload | {revision} | this tree | speed-up | attention {revision} | "
        "attention this tree | attention speed-up |",
        "|---|---:|---:|---:|---:|---:|---:|",
        *(
            f"| {r['workload']} | {figure(r[revision]['seconds'])} | "
            f"{figure(r['this tree']['seconds'])} | {ratio(r, 'seconds'):.2f}x | "
            f"{figure(r[revision]['attention_s'])} | {figure(r['this tree']['attention_s'])} | "
            f"{ratio(r, 'attention_s'):.2f}x |"
            for r in rows
        ),
        "",
    ]
    extra = () if stem == "decode-attention-ab" else (stem,)
    write_results(out_dir, stem, report, lines, command_line(__file__, revision, out_dir, *extra))


if __name__ == "__main__":
    main()
