"""`forklift bench profile`: where a pure decode step's time goes, by kind of work.

torch.profiler records every operator of a few decode steps. Each operator's own (self)
CPU time goes to one bucket: matrix work, attention (SDPA and the paged gathers and
writes), sampling, or other tensor ops (norms, rotary, activations, copies). What the step's
wall time has beyond all operators is Python and dispatch: scheduling, input preparation,
output processing. The profiler adds a little overhead of its own to every operator.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.profiler import ProfilerActivity, profile

from forklift.bench.decode import decode_step_budget, prefill_steps
from forklift.bench.report import cpu_flags, subplots, write_report_files
from forklift.llm import LLM
from forklift.native.decode_attention_kernel import PROFILER_NAME as NATIVE_ATTENTION
from forklift.native.decode_step import PROFILER_NAME as NATIVE_STEP
from forklift.native.quant_matmul import PROFILER_NAME as NATIVE_MATMUL
from forklift.native.seeded_sample import PROFILER_NAME as NATIVE_SAMPLER
from forklift.sampling_params import SamplingParams

if TYPE_CHECKING:
    from matplotlib.figure import Figure

CATEGORIES = ("matrix", "attention", "sampling", "other ops", "python and dispatch")

_MATRIX = {"aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear",
           "mkldnn::_linear_pointwise", "aten::_weight_int4pack_mm_for_cpu",
           "aten::_weight_int8pack_mm", NATIVE_MATMUL}  # fmt: skip
# In an eager step the only compiled code is the in-place decode attention kernel (where
# the native one is missing).
_COMPILED_GRAPH = "CompiledFxGraph"
_ATTENTION_PREFIXES = ("aten::_scaled_dot_product", "aten::scaled_dot_product")
_ATTENTION = {"aten::index_select", "aten::index_copy_", "aten::index", NATIVE_ATTENTION}
_SAMPLING = {"aten::argmax", "aten::max", "aten::log_softmax", "aten::_log_softmax", "aten::topk",
             "aten::sort", "aten::gather", "aten::softmax", "aten::_softmax",
             NATIVE_SAMPLER}  # fmt: skip


def categorize(op_name: str) -> str:
    if op_name in _MATRIX:
        return "matrix"
    if (
        op_name in _ATTENTION
        or op_name.startswith(_ATTENTION_PREFIXES)
        or _COMPILED_GRAPH in op_name
    ):
        return "attention"
    if op_name in _SAMPLING:
        return "sampling"
    return "other ops"


@dataclass
class StepBreakdown:
    batch_size: int
    steps: int
    wall_ms_per_step: float
    ms_per_step: dict[str, float]


def profile_decode(
    llm: LLM, batch: int, steps: int, seed: int = 0, context: int = 16
) -> StepBreakdown:
    engine = llm.llm_engine
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    # Requests prefilled in earlier chunks decode while later ones still prefill: give them
    # enough tokens to last until every request decodes.
    prefill = prefill_steps(batch, context, engine.config.resolve_max_num_batched_tokens())
    params = SamplingParams(temperature=0, max_tokens=steps + 3 + prefill, ignore_eos=True)
    before = engine.step_log[-1].index if engine.step_log else 0
    for _ in range(batch):
        engine.add_request(None, [rng.randrange(vocab) for _ in range(context)], params)
    # Prefill, then one decode step outside the profile (one-time allocations).
    engine.step()
    while engine.step_log[-1].num_batched_tokens != batch or engine.step_log[-1].index <= before:
        engine.step()
    first = engine.step_log[-1].index
    native = engine.runner.native_step
    if native is not None:
        native.start_timing()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    # A native step is one operator to the profiler: its own timers split it.
    timed = native.stop_timing() if native is not None else None
    records = [s for s in engine.step_log if s.index > first]
    if any(s.num_batched_tokens != batch for s in records):
        raise RuntimeError("a profiled step was not a pure decode step")
    while engine.has_unfinished_requests():
        engine.step()
    buckets = dict.fromkeys(CATEGORIES, 0.0)
    for event in prof.key_averages():
        if event.key != NATIVE_STEP:
            buckets[categorize(event.key)] += event.self_cpu_time_total / 1000  # us -> ms
    if timed is not None:
        buckets["matrix"] += 1000 * timed.matrix
        buckets["attention"] += 1000 * timed.attention
        buckets["other ops"] += 1000 * timed.other
    wall_ms = 1000 * sum(s.duration_s for s in records)
    buckets["python and dispatch"] = max(wall_ms - sum(buckets.values()), 0.0)
    return StepBreakdown(batch, steps, wall_ms / steps, {k: v / steps for k, v in buckets.items()})


def run_profile_bench(
    model: str | None,
    dtype: str,
    batch_sizes: tuple[int, ...],
    steps: int,
    context: int = 564,
    quantization: str = "auto",
    decode_backend: str = "auto",
) -> dict[str, Any]:
    longest = max(batch_sizes)
    budget = decode_step_budget(longest)
    llm = LLM(model=model, dtype=dtype, quantization=quantization, decode_backend=decode_backend,
              max_model_len=context + steps + 8 + prefill_steps(longest, context, budget),
              max_num_seqs=longest, max_num_batched_tokens=budget)  # fmt: skip
    profile_decode(llm, 1, 2, context=context)  # warm-up
    engine = llm.llm_engine
    breakdowns = [profile_decode(llm, b, steps, seed=b, context=context) for b in batch_sizes]
    return {
        "benchmark": "profile",
        "cpu_flags": cpu_flags(),
        "model": str(engine.model_source.path.name),
        "dtype": str(engine.dtype).removeprefix("torch."),
        "quantization": engine.quantization,
        "decode_step": (
            "one native call" if engine.runner.native_step is not None else "PyTorch layers"
        ),
        "context": context,
        "threads": torch.get_num_threads(),
        "breakdowns": [asdict(b) for b in breakdowns],
    }


def render_markdown(report: dict[str, Any]) -> str:
    lines = [
        "# Where a decode step's time goes",
        "",
        f"Command: `{report['command']}`",
        "",
        f"Model {report['model']}, dtype {report['dtype']}, quantization "
        f"{report['quantization']}, {report['threads']} threads, decode step: "
        f"{report.get('decode_step', 'PyTorch layers')}, at a context of "
        f"{report['context']} tokens. Operators' own CPU time by kind (torch.profiler; a "
        "native step's own timers split its one call); python and dispatch is the step's "
        "wall time beyond all operators (scheduling, input preparation, outputs). "
        f"CPU flags: {' '.join(report.get('cpu_flags', [])) or 'n/a'}. "
        "Milliseconds per step, with the share of the step.",
        "",
        "| batch | step (ms) | " + " | ".join(CATEGORIES) + " |",
        "|---" * (len(CATEGORIES) + 2) + "|",
    ]
    for b in report["breakdowns"]:
        wall = b["wall_ms_per_step"]
        cells = [f"{b['ms_per_step'][c]:.1f} ({100 * b['ms_per_step'][c] / wall:.0f}%)"
                 for c in CATEGORIES]  # fmt: skip
        lines.append(f"| {b['batch_size']} | {wall:.1f} | " + " | ".join(cells) + " |")
    lines.append("")
    return "\n".join(lines)


def write_report(report: dict[str, Any], out_dir: Path) -> list[Path]:
    return write_report_files(report, out_dir, "profile", render_markdown, _plot)


def _plot(report: dict[str, Any]) -> Figure:
    breakdowns = report["breakdowns"]
    labels = [f"batch {b['batch_size']}" for b in breakdowns]
    fig, axis = subplots(figsize=(7, 4))
    bottom = [0.0] * len(breakdowns)
    for category in CATEGORIES:
        values = [b["ms_per_step"][category] for b in breakdowns]
        axis.bar(labels, values, bottom=bottom, label=category)
        bottom = [x + v for x, v in zip(bottom, values, strict=True)]
    axis.set_ylabel("ms per decode step")
    axis.set_title("Decode step breakdown (eager)")
    axis.legend()
    return fig
