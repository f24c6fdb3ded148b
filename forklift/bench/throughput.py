"""`forklift bench throughput`: forklift vs HF `generate()` with static batches, one process.

Both sides get the same model, dtype, prompt token ids and per-request output lengths
(`ignore_eos`). HF runs static batches in arrival order, each until its longest request is
done, and is credited only with the tokens each request asked for; the rest of its token
slots are the "bubbles" of static batching.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from forklift.bench.report import cpu_flags, subplots, write_report_files
from forklift.bench.workload import DEFAULT_OUTPUT_LENGTHS, offline_mixed
from forklift.hf_reference import load_hf_model, run_static_batches
from forklift.llm import LLM
from forklift.sampling_params import SamplingParams

if TYPE_CHECKING:
    from matplotlib.figure import Figure


@dataclass
class ThroughputSettings:
    model: str | None = None
    dtype: str = "auto"
    num_requests: int = 32
    output_lengths: tuple[int, ...] = DEFAULT_OUTPUT_LENGTHS
    hf_batch_size: int = 8
    max_model_len: int = 2048

    @classmethod
    def quick(cls, **overrides: Any) -> ThroughputSettings:
        return cls(**{"num_requests": 8, "output_lengths": (8, 16), "hf_batch_size": 4,
                      "max_model_len": 512, **overrides})  # fmt: skip


@dataclass
class SideResult:
    wall_s: float
    output_tokens: int
    output_tokens_per_s: float
    per_request_output_tokens: list[int]
    extra: dict[str, float] = field(default_factory=dict)


def run_throughput(settings: ThroughputSettings) -> dict[str, Any]:
    workload = offline_mixed(settings.num_requests, settings.output_lengths)
    llm = LLM(
        model=settings.model,
        dtype=settings.dtype,
        max_model_len=settings.max_model_len,
        max_num_seqs=max(settings.num_requests, 1),
    )
    engine = llm.llm_engine
    tokenizer = engine.tokenizer
    if tokenizer is None:
        raise ValueError("the throughput benchmark needs a model with a tokenizer")
    prompts = [tokenizer.encode_chat([{"role": "user", "content": text}]) for text, _ in workload]
    lengths = [length for _, length in workload]
    source_model = load_hf_model(engine.model_source, engine.model_config, engine.dtype)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    # Warm both sides up so one-time costs land outside the timed runs.
    run_static_batches(source_model, prompts[:1], [2], 1, pad)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)

    hf = run_static_batches(source_model, prompts, lengths, settings.hf_batch_size, pad)
    hf_side = SideResult(
        wall_s=hf.wall_s,
        output_tokens=hf.useful_tokens,
        output_tokens_per_s=hf.useful_tokens / hf.wall_s,
        per_request_output_tokens=[len(o) for o in hf.outputs],
        extra={
            "batch_size": settings.hf_batch_size,
            "token_slots": hf.token_slots,
            "wasted_slots": hf.token_slots - hf.useful_tokens,
            "waste_fraction": 1 - hf.useful_tokens / hf.token_slots,
        },
    )
    forklift_side = _run_forklift(llm, prompts, lengths)
    return {
        "benchmark": "throughput",
        "cpu_flags": cpu_flags(),
        "workload": {
            "name": "offline-mixed",
            "num_requests": settings.num_requests,
            "output_lengths": list(settings.output_lengths),
            "requested_output_tokens": lengths,
            "prompt_tokens": [len(p) for p in prompts],
        },
        "model": str(engine.model_source.path.name),
        "dtype": str(engine.dtype).removeprefix("torch."),
        "hf": asdict(hf_side),
        "forklift": asdict(forklift_side),
        "speedup": forklift_side.output_tokens_per_s / hf_side.output_tokens_per_s,
    }


def _run_forklift(llm: LLM, prompts: list[list[int]], lengths: list[int]) -> SideResult:
    engine = llm.llm_engine
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    first_step = engine.step_log[-1].index if engine.step_log else 0
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    steps = [s for s in engine.step_log if s.index > first_step]
    produced = [len(o.outputs[0].token_ids) for o in outputs]
    return SideResult(
        wall_s=wall,
        output_tokens=sum(produced),
        output_tokens_per_s=sum(produced) / wall,
        per_request_output_tokens=produced,
        extra={
            "num_steps": len(steps),
            "mean_running_batch": sum(len(s.request_ids) for s in steps) / max(len(steps), 1),
            "preemptions": sum(s.num_preempted for s in steps),
        },
    )


def write_report(report: dict[str, Any], out_dir: Path, command: str) -> list[Path]:
    report = {**report, "command": command}
    return write_report_files(report, out_dir, "throughput", render_markdown, _plot)


def render_markdown(report: dict[str, Any]) -> str:
    hf, fk, work = report["hf"], report["forklift"], report["workload"]
    lines = [
        "# Offline throughput: forklift vs HF transformers `generate()`",
        "",
        f"Command: `{report['command']}`",
        "",
        f"Model {report['model']}, dtype {report['dtype']}, workload {work['name']}: "
        f"{work['num_requests']} chat instructions, output lengths cycling "
        f"{', '.join(map(str, work['output_lengths']))} (`ignore_eos`), both sides in one process. "
        f"CPU flags: {' '.join(report.get('cpu_flags', [])) or 'n/a'}.",
        "",
        "| engine | output tokens | wall (s) | output tok/s | notes |",
        "|---|---|---|---|---|",
        f"| HF generate, static batches of {hf['extra']['batch_size']} | {hf['output_tokens']} | "
        f"{hf['wall_s']:.1f} | {hf['output_tokens_per_s']:.1f} | "
        f"{hf['extra']['wasted_slots']} of {hf['extra']['token_slots']} token slots wasted "
        f"({100 * hf['extra']['waste_fraction']:.0f}%) |",
        f"| forklift, continuous batching | {fk['output_tokens']} | {fk['wall_s']:.1f} | "
        f"{fk['output_tokens_per_s']:.1f} | mean running batch "
        f"{fk['extra']['mean_running_batch']:.1f} over {fk['extra']['num_steps']} steps |",
        "",
        f"**forklift / HF: {report['speedup']:.2f}x** output tokens per second.",
        "",
    ]
    return "\n".join(lines)


def _plot(report: dict[str, Any]) -> Figure:
    hf, fk = report["hf"], report["forklift"]
    fig, (left, right) = subplots(1, 2, figsize=(10, 4))
    left.bar(["HF generate", "forklift"], [hf["output_tokens_per_s"], fk["output_tokens_per_s"]],
             color=["#999999", "#2a7ab0"])  # fmt: skip
    left.set_ylabel("output tokens / s")
    left.set_title(f"Throughput ({report['speedup']:.2f}x)")
    useful, wasted = hf["output_tokens"], hf["extra"]["wasted_slots"]
    right.bar(["HF static batches"], [useful], label="useful", color="#2a7ab0")
    right.bar(["HF static batches"], [wasted], bottom=[useful], label="wasted", color="#d95f02")
    right.set_ylabel("token slots")
    right.set_title("Static batching bubbles")
    right.legend()
    return fig
