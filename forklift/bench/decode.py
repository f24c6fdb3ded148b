"""`forklift bench decode`: the time of a pure decode step by batch size, against the machine's
matrix peak measured in the same run.

For each batch size the engine gets that many short requests, runs their prefill, then times
steps in which every request decodes exactly one token. The matrix work of such a step is
2 x (linear-layer weights) x batch FLOPs; dividing by the step time and by the FLOP/s of a
large square matmul in the same dtype gives the fraction of peak the step reaches.
"""

from __future__ import annotations

import gc
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from forklift.bench.report import write_report_files
from forklift.llm import LLM
from forklift.model.model_config import ModelConfig
from forklift.sampling_params import SamplingParams

# enforce_eager=True, then enforce_eager=False (CUDA graphs on a GPU, compiled regions on a CPU).
MODES = ("eager", "captured")


@dataclass
class DecodeSettings:
    model: str | None = None
    dtype: str = "auto"
    batch_sizes: tuple[int, ...] = (1, 8, 32, 128, 256)
    prompt_tokens: int = 16
    timed_steps: int = 6
    gemm_size: int = 2048

    @classmethod
    def quick(cls, **overrides: Any) -> DecodeSettings:
        return cls(**{"batch_sizes": (1, 8), "timed_steps": 3, "gemm_size": 1024,
                      **overrides})  # fmt: skip


def linear_weights(config: ModelConfig) -> int:
    """Weights that every decoded token multiplies: all projections plus the LM head."""
    hidden, inter = config.hidden_size, config.intermediate_size
    per_layer = hidden * (config.q_size + 2 * config.kv_size)  # fused qkv
    per_layer += config.q_size * hidden  # o_proj
    per_layer += hidden * 2 * inter + inter * hidden  # gate_up, down
    return config.num_layers * per_layer + config.vocab_size * hidden


def gemm_peak_flops(size: int, dtype: torch.dtype, repeats: int = 5) -> float:
    a = torch.randn(size, size, dtype=dtype)
    b = torch.randn(size, size, dtype=dtype)
    torch.mm(a, b)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - start)
    return 2 * size**3 / min(times)


@dataclass
class DecodePoint:
    batch_size: int
    mode: str
    step_ms_median: float
    step_ms_min: float
    tokens_per_s: float
    matrix_flops_per_s: float
    fraction_of_peak: float


def _time_decode(llm: LLM, batch: int, settings: DecodeSettings, seed: int) -> list[float]:
    engine = llm.llm_engine
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    budget = settings.timed_steps + 4
    params = SamplingParams(temperature=0, max_tokens=budget, ignore_eos=True)
    for _ in range(batch):
        prompt = [rng.randrange(vocab) for _ in range(settings.prompt_tokens)]
        engine.add_request(None, prompt, params)
    first = engine.step_log[-1].index if engine.step_log else 0
    while engine.has_unfinished_requests():
        engine.step()
    # Pure decode steps: every one of the `batch` requests computed exactly one token.
    decode = [
        s.duration_s
        for s in engine.step_log
        if s.index > first and s.num_batched_tokens == batch and s.num_sampled == batch
    ]
    if len(decode) < settings.timed_steps + 1:
        raise RuntimeError(f"only {len(decode)} pure decode steps at batch {batch}")
    # Skip the first decode step (one-time allocations), keep the next timed_steps.
    return decode[1 : 1 + settings.timed_steps]


def _measure_mode(settings: DecodeSettings, mode: str) -> tuple[LLM, list[list[float]]]:
    longest = max(settings.batch_sizes)
    llm = LLM(
        model=settings.model,
        dtype=settings.dtype,
        max_model_len=settings.prompt_tokens + settings.timed_steps + 8,
        max_num_seqs=longest,
        max_num_batched_tokens=max(2048, longest),
        enforce_eager=mode == "eager",
        decode_capture_sizes=settings.batch_sizes,
    )
    _time_decode(llm, 1, settings, seed=0)  # warm-up
    return llm, [_time_decode(llm, b, settings, seed=b) for b in settings.batch_sizes]


def run_decode_bench(settings: DecodeSettings) -> dict[str, Any]:
    points = []
    engine = None
    for mode in MODES:
        llm, timings = _measure_mode(settings, mode)
        engine = llm.llm_engine
        if mode == MODES[0]:
            peak = gemm_peak_flops(settings.gemm_size, engine.dtype)
            weights = linear_weights(engine.model_config)
        for batch, times in zip(settings.batch_sizes, timings, strict=True):
            median = statistics.median(times)
            flops = 2 * weights * batch / median
            points.append(
                DecodePoint(
                    batch,
                    mode,
                    1000 * median,
                    1000 * min(times),
                    batch / median,
                    flops,
                    flops / peak,
                )  # fmt: skip
            )
        del llm
        gc.collect()
    assert engine is not None
    return {
        "benchmark": "decode",
        "model": str(engine.model_source.path.name),
        "dtype": str(engine.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "device": engine.device.type,
        "capture_backend": "cuda-graph" if engine.device.type == "cuda" else "torch-compile",
        "settings": asdict(settings),
        "linear_weights": weights,
        "gemm_peak_flops_per_s": peak,
        "points": [asdict(p) for p in points],
        "speedup": captured_speedup(points),
    }


def captured_speedup(points: list[DecodePoint]) -> dict[int, float]:
    """Eager step time / captured step time, by batch size."""
    eager = {p.batch_size: p.step_ms_median for p in points if p.mode == "eager"}
    return {
        p.batch_size: eager[p.batch_size] / p.step_ms_median
        for p in points
        if p.mode == "captured" and p.batch_size in eager
    }


def render_markdown(report: dict[str, Any]) -> str:
    s = report["settings"]
    lines = [
        "# Decode step time by batch size",
        "",
        f"Command: `{report['command']}`",
        "",
        f"Model {report['model']}, dtype {report['dtype']}, {report['threads']} threads. "
        f"Each batch size: that many requests of {s['prompt_tokens']} prompt tokens; the "
        f"median of {s['timed_steps']} steps in which every request decodes one token. "
        f"Matrix work per step: 2 x {report['linear_weights'] / 1e6:.1f} M linear weights x "
        f"batch. Peak: a {s['gemm_size']}x{s['gemm_size']} matmul in the same dtype, same run: "
        f"**{report['gemm_peak_flops_per_s'] / 1e9:.1f} GFLOP/s**.",
        "",
        "| batch | mode | step (ms) | min (ms) | tokens/s | matrix GFLOP/s | of peak |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in sorted(report["points"], key=lambda p: (p["batch_size"], p["mode"] != "eager")):
        lines.append(
            f"| {p['batch_size']} | {p['mode']} | {p['step_ms_median']:.1f} | "
            f"{p['step_ms_min']:.1f} | {p['tokens_per_s']:.1f} | "
            f"{p['matrix_flops_per_s'] / 1e9:.1f} | {100 * p['fraction_of_peak']:.1f}% |"
        )
    lines += [
        "",
        f"Captured mode ({report['capture_backend']} on {report['device']}): eager step time / "
        "captured step time by batch size: "
        + ", ".join(f"{b}: **{x:.2f}x**" for b, x in report["speedup"].items())
        + ".",
        "",
    ]
    return "\n".join(lines)


def write_report(report: dict[str, Any], out_dir: Path) -> list[Path]:
    return write_report_files(report, out_dir, "decode", render_markdown, _plot)


def _plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for mode, color in zip(MODES, ("#2a7ab0", "#d95f02"), strict=True):
        points = [p for p in report["points"] if p["mode"] == mode]
        batches = [p["batch_size"] for p in points]
        steps = [p["step_ms_median"] for p in points]
        left.plot(batches, steps, "o-", color=color, label=mode)
        right.plot(batches, [100 * p["fraction_of_peak"] for p in points], "o-", color=color)
    left.set_ylabel("decode step (ms)")
    left.set_title("Step time")
    left.legend()
    right.set_ylabel("% of measured GEMM peak")
    right.set_title("Matrix efficiency")
    for axis in (left, right):
        axis.set_xscale("log", base=2)
        axis.set_xticks(batches, [str(b) for b in batches])
        axis.set_xlabel("batch size")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
