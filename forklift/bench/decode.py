"""`forklift bench decode`: a pure decode step by weight form and batch size, against the
machine's read bandwidth measured in the same run (and llama.cpp's `llama-bench` on the same
file, when given one).

For each weight form (dense fp32, dense bf16, int8, int4) and batch size, the engine gets that
many requests of `context` prompt tokens, runs their prefill, then times steps in which every
request decodes exactly one token. At small batch such a step reads every weight once and
every sequence's KV cache once, so its floor is those bytes over the read bandwidth.
"""

from __future__ import annotations

import contextlib
import gc
import json
import random
import statistics
import subprocess
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from forklift.bench.environment import environment_variable
from forklift.bench.report import cpu_flags, subplots, write_report_files
from forklift.cpu import CPU_KIND_ENV
from forklift.llm import LLM
from forklift.lora_request import LoRARequest
from forklift.model.layers.linear import Linear
from forklift.model.model_config import ModelConfig
from forklift.native.build import DISABLE_ENV
from forklift.runner.memory import kv_bytes_per_token, state_bytes_per_sequence
from forklift.sampling_params import SamplingParams

if TYPE_CHECKING:
    from matplotlib.figure import Figure


# Decode steps a single-stream round times (llama-bench's tg128 decodes 128 tokens, 5 times).
PEER_ROUND_STEPS = 64


@dataclass(frozen=True)
class WeightForm:
    """One row group of the report: how the engine holds and runs its weights."""

    name: str
    dtype: str
    quantization: str
    enforce_eager: bool = True
    # False: every kernel on PyTorch's (no native library at all), side by side.
    native_kernels: bool = True
    decode_backend: str = "auto"
    # "avx2": the engine built as on an AVX2-only CPU (FORKLIFT_CPU_KIND): fp32 model,
    # native kernels compiled for x86-64-v3. The machine's memory and clocks stay its own.
    cpu_kind: str | None = None
    kv_cache_dtype: str = "auto"


WEIGHT_FORMS = {
    "fp32": WeightForm("fp32", "float32", "none"),
    "bf16": WeightForm("bf16", "bfloat16", "none"),
    "int8": WeightForm("int8", "bfloat16", "int8"),
    # A Q4 GGUF at its own precision; the native decode step where it builds.
    "int4": WeightForm("int4", "bfloat16", "auto"),
    "int4-avx2": WeightForm("int4-avx2", "auto", "auto", cpu_kind="avx2"),
    # The same with an int8 KV cache (kv_cache_dtype="int8").
    "int4-kv8": WeightForm("int4-kv8", "bfloat16", "auto", kv_cache_dtype="int8"),
    "int4-avx2-kv8": WeightForm(
        "int4-avx2-kv8", "auto", "auto", cpu_kind="avx2", kv_cache_dtype="int8"
    ),
    # PyTorch's int4 / int8 kernels and layers (native decode attention).
    "int4-torch": WeightForm("int4-torch", "bfloat16", "auto", decode_backend="torch"),
    "int4-captured": WeightForm(
        "int4-captured", "bfloat16", "auto", enforce_eager=False, decode_backend="torch"
    ),
    "int4-torch-attention": WeightForm(
        "int4-torch-attention", "bfloat16", "auto", native_kernels=False
    ),
}


@dataclass
class DecodeSettings:
    model: str | None = None
    forms: tuple[str, ...] = ("fp32", "bf16", "int8", "int4-torch", "int4")
    batch_sizes: tuple[int, ...] = (1, 8, 16, 32)
    context: int = 564
    timed_steps: int = 8
    llama_bench: str | None = None  # path to llama.cpp's llama-bench binary
    # Rounds that alternate forklift's single stream with llama-bench (this kind of machine
    # moves by 10-25% within minutes: one round each says little about the ratio).
    peer_rounds: int = 3

    @classmethod
    def quick(cls, **overrides: Any) -> DecodeSettings:
        return cls(**{"forms": ("bf16", "int4"), "batch_sizes": (1, 4), "context": 64,
                      "timed_steps": 3, **overrides})  # fmt: skip

    def __post_init__(self) -> None:
        if self.peer_rounds < 1:
            raise ValueError(f"peer_rounds must be at least 1, got {self.peer_rounds}")
        unknown = [f for f in self.forms if f not in WEIGHT_FORMS]
        if unknown:
            raise ValueError(
                f"unknown weight form(s) {', '.join(unknown)}; choose from "
                f"{', '.join(WEIGHT_FORMS)}"
            )


def linear_weights(config: ModelConfig) -> int:
    """Weights that every decoded token multiplies: all projections plus the LM head."""
    hidden, inter = config.hidden_size, config.intermediate_size
    attention = hidden * (config.q_proj_size + 2 * config.kv_size)  # fused qkv
    attention += config.q_size * hidden  # o_proj
    mlp = hidden * 2 * inter + inter * hidden  # gate_up, down
    total = len(config.attention_layers) * attention + config.num_layers * mlp
    shape = config.linear_attention
    if shape is not None:  # fused q/k/v, z, b, a in; out
        linear = hidden * (shape.conv_channels + shape.value_size + 2 * shape.num_value_heads)
        total += len(config.linear_layers) * (linear + shape.value_size * hidden)
    return total + config.vocab_size * hidden


def read_bandwidth(size_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes per second a sum over a tensor far larger than the caches reads."""
    data = torch.ones(size_bytes // 4, dtype=torch.float32)
    data.sum()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return size_bytes / best


def weight_bytes_per_step(llm: LLM, batch: int) -> int:
    """Bytes of the weight copies a decode step of `batch` rows reads (quantized copies where
    the step is small enough to use them, else the dense or packed ones)."""
    model = llm.llm_engine.runner.model
    total = 0
    for module in model.modules():
        if not isinstance(module, Linear):
            continue
        dropped = module.weight.is_meta  # the blocks take every step
        if module.quantized is not None and (batch <= module.quantized.max_rows or dropped):
            total += module.quantized.nbytes
        else:
            total += _dense_bytes(module.packed_weight if module.packed_weight is not None
                                  else module.weight)  # fmt: skip
    if model.lm_head is None:
        if model.quantized_head is not None and (
            batch <= model.quantized_head.max_rows or model.head_blocks_only
        ):
            total += model.quantized_head.nbytes
        else:
            total += _dense_bytes(model.embed_tokens.weight)
    return total


def kv_bytes_per_step(llm: LLM, batch: int, context: int) -> int:
    """Bytes of K and V a decode step reads (whole blocks of every sequence, every
    full-attention layer), plus a hybrid model's linear-layer state of each sequence."""
    engine = llm.llm_engine
    config = engine.model_config
    block = engine.config.block_size
    positions = -(-context // block) * block
    per_token = kv_bytes_per_token(config, engine.runner.kv_format)
    return batch * (positions * per_token + state_bytes_per_sequence(config, engine.dtype))


def _dense_bytes(tensor: torch.Tensor) -> int:
    """Bytes of a dense weight; none where it was dropped for its blocks (meta)."""
    return 0 if tensor.is_meta else tensor.numel() * tensor.element_size()


@dataclass
class DecodePoint:
    form: str
    batch_size: int
    step_ms_median: float
    step_ms_min: float
    tokens_per_s: float
    weight_bytes: int
    kv_bytes: int
    fraction_of_bandwidth: float


def _build_llm(settings: DecodeSettings, form: WeightForm, longest: int, budget: int) -> LLM:
    return LLM(
        model=settings.model,
        dtype=form.dtype,
        quantization=form.quantization,
        max_model_len=settings.context
        + max(settings.timed_steps, PEER_ROUND_STEPS)
        + 8
        + prefill_steps(longest, settings.context, budget),
        max_num_seqs=longest,
        max_num_batched_tokens=budget,
        enforce_eager=form.enforce_eager,
        decode_capture_sizes=settings.batch_sizes,
        decode_backend=form.decode_backend,
        kv_cache_dtype=form.kv_cache_dtype,
    )


def native_kernels_enabled(enabled: bool) -> contextlib.AbstractContextManager[None]:
    """Build an engine with or without the native kernels (read when its model is built)."""
    return contextlib.nullcontext() if enabled else environment_variable(DISABLE_ENV, "0")


def cpu_kind(kind: str | None) -> contextlib.AbstractContextManager[None]:
    """Build an engine as on another kind of CPU (read when its model is built)."""
    return contextlib.nullcontext() if kind is None else environment_variable(CPU_KIND_ENV, kind)


def _time_decode(llm: LLM, batch: int, settings: DecodeSettings, seed: int) -> list[float]:
    return time_pure_decode(llm, batch, settings.context, settings.timed_steps, random.Random(seed))


def time_pure_decode(
    llm: LLM,
    batch: int,
    context: int,
    count: int,
    rng: random.Random,
    *,
    margin: int = 4,
    strict: bool = True,
    lora_requests: Sequence[LoRARequest | None] = (),
) -> list[float]:
    """Durations of `count` steps in which each of `batch` requests of `context` random prompt
    tokens decodes one token. `margin` extra output tokens per request; `strict` raises when
    fewer such steps ran; request i runs adapter `lora_requests[i % len]` (none if empty)."""
    engine = llm.llm_engine
    vocab = engine.model_config.vocab_size
    # Requests prefilled in earlier chunks decode while later ones still prefill: give them
    # enough tokens to last until every request decodes.
    budget = engine.config.resolve_max_num_batched_tokens()
    tokens = count + margin + prefill_steps(batch, context, budget)
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    for index in range(batch):
        prompt = [rng.randrange(vocab) for _ in range(context)]
        lora = lora_requests[index % len(lora_requests)] if lora_requests else None
        engine.add_request(None, prompt, params, lora_request=lora)
    first = engine.step_log[-1].index if engine.step_log else 0
    while engine.has_unfinished_requests():
        engine.step()
    # Pure decode steps: every one of the `batch` requests computed exactly one token.
    decode = [
        s.duration_s
        for s in engine.step_log
        if s.index > first and s.num_batched_tokens == batch and s.num_sampled == batch
    ]
    if strict and len(decode) < count + 1:
        raise RuntimeError(f"only {len(decode)} pure decode steps at batch {batch}")
    # Skip the first decode step (one-time allocations), keep the next `count`.
    return decode[1 : 1 + count]


def decode_step_budget(batch: int) -> int:
    """The token budget a decode benchmark's engine gets for this largest batch."""
    return max(2048, batch)


def prefill_steps(batch: int, context: int, budget: int) -> int:
    """Steps that `batch` prompts of `context` tokens take to prefill in chunks of `budget`:
    the first requests decode that many steps before the last one does."""
    return -(-batch * context // budget)


def _measure_form(
    settings: DecodeSettings, form: WeightForm, bandwidth: float
) -> tuple[list[DecodePoint], LLM]:
    longest = max(settings.batch_sizes)
    budget = decode_step_budget(longest)
    with native_kernels_enabled(form.native_kernels), cpu_kind(form.cpu_kind):
        llm = _build_llm(settings, form, longest, budget)
    _time_decode(llm, 1, settings, seed=0)  # warm-up
    points = []
    for batch in settings.batch_sizes:
        times = _time_decode(llm, batch, settings, seed=batch)
        median = statistics.median(times)
        weights = weight_bytes_per_step(llm, batch)
        kv = kv_bytes_per_step(llm, batch, settings.context)
        points.append(
            DecodePoint(
                form.name,
                batch,
                1000 * median,
                1000 * min(times),
                batch / median,
                weights,
                kv,
                (weights + kv) / median / bandwidth,
            )  # fmt: skip
        )
    return points, llm


def run_llama_bench(binary: str, model: Path, context: int, threads: int) -> dict[str, Any]:
    """llama.cpp's single-stream decode at depth `context` on the same file (flash attention
    off: on these CPUs it halves decode at depth)."""
    command = [binary, "-m", str(model), "-t", str(threads), "-p", "0", "-n", "128",
               "-d", str(context), "-fa", "0", "-o", "json"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=True, timeout=900)
    rows = json.loads(done.stdout)
    # The report names the model file, not where it sits on this machine.
    shown = [model.name if part == str(model) else part for part in command[1:]]
    return {"command": " ".join(shown), "tokens_per_s": float(rows[0]["avg_ts"]),
            "stddev": float(rows[0].get("stddev_ts", 0.0))}  # fmt: skip


def compare_with_llama_bench(
    llm: LLM, form: str, settings: DecodeSettings, threads: int
) -> dict[str, Any]:
    """Rounds that run forklift's single stream and then llama-bench, one after the other:
    each round's ratio sets the two side by side within a minute; the report's ratio is the
    median of the rounds'."""
    assert settings.llama_bench is not None
    model = llm.llm_engine.model_source.path
    rounds = []
    for index in range(settings.peer_rounds):
        times = time_pure_decode(
            llm, 1, settings.context, PEER_ROUND_STEPS, random.Random(1000 + index)
        )
        ours = 1 / statistics.median(times)
        peer = run_llama_bench(settings.llama_bench, model, settings.context, threads)
        rounds.append({"forklift_tokens_per_s": ours, "tokens_per_s": peer["tokens_per_s"],
                       "stddev": peer["stddev"], "ratio": ours / peer["tokens_per_s"]})  # fmt: skip
    return {
        "command": peer["command"],
        "forklift_form": form,
        "rounds": rounds,
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rounds),
        "forklift_tokens_per_s": statistics.median(r["forklift_tokens_per_s"] for r in rounds),
        "ratio": statistics.median(r["ratio"] for r in rounds),
    }


def run_decode_bench(settings: DecodeSettings) -> dict[str, Any]:
    bandwidth = read_bandwidth()
    points: list[DecodePoint] = []
    engine = None
    # The form with the fastest single stream stays loaded for the rounds against llama-bench.
    fastest: tuple[float, str, LLM] | None = None
    for name in settings.forms:
        form_points, llm = _measure_form(settings, WEIGHT_FORMS[name], bandwidth)
        points += form_points
        engine = llm.llm_engine
        single = [p.tokens_per_s for p in form_points if p.batch_size == 1]
        if settings.llama_bench and single and (fastest is None or single[0] > fastest[0]):
            fastest = (single[0], name, llm)
        del llm
        gc.collect()
    assert engine is not None
    report: dict[str, Any] = {
        "benchmark": "decode",
        "model": str(engine.model_source.path.name),
        "threads": torch.get_num_threads(),
        "device": engine.device.type,
        "cpu_flags": cpu_flags(),
        # The peer binary's path stays out of the report (it is this machine's).
        "settings": {**asdict(settings), "llama_bench": bool(settings.llama_bench)},
        "linear_weights": linear_weights(engine.model_config),
        "read_bandwidth_bytes_per_s": bandwidth,
        "points": [asdict(p) for p in points],
        "batch_cost": batch_cost(points),
    }
    if fastest is not None:
        _, form, llm = fastest
        report["llama_bench"] = compare_with_llama_bench(llm, form, settings, report["threads"])
    return report


def batch_cost(points: list[DecodePoint]) -> dict[str, dict[int, float]]:
    """Step time at each batch size over the batch-1 step time, per weight form."""
    cost: dict[str, dict[int, float]] = {}
    for form in dict.fromkeys(p.form for p in points):
        steps = {p.batch_size: p.step_ms_median for p in points if p.form == form}
        if 1 in steps:
            cost[form] = {b: t / steps[1] for b, t in steps.items()}
    return cost


def render_markdown(report: dict[str, Any]) -> str:
    s = report["settings"]
    lines = [
        "# Decode step time by weight form and batch size",
        "",
        f"Command: `{report['command']}`",
        "",
        f"Model {report['model']}, {report['threads']} threads, CPU flags: "
        f"{' '.join(report['cpu_flags']) or 'n/a'}. Each batch size: that many requests of "
        f"{s['context']} prompt tokens; the median of {s['timed_steps']} steps in which every "
        f"request decodes one token. Bytes per step: the weight copies the step reads plus "
        f"every sequence's K and V; read bandwidth (a sum over 1 GiB, same run): "
        f"**{report['read_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s**.",
        "",
        "| form | batch | step (ms) | min (ms) | tokens/s | weights MB | KV MB | of bandwidth |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in report["points"]:
        lines.append(
            f"| {p['form']} | {p['batch_size']} | {p['step_ms_median']:.1f} | "
            f"{p['step_ms_min']:.1f} | {p['tokens_per_s']:.1f} | {p['weight_bytes'] / 1e6:.0f} | "
            f"{p['kv_bytes'] / 1e6:.1f} | {100 * p['fraction_of_bandwidth']:.0f}% |"
        )
    lines += ["", "Step time over the batch-1 step time:", ""]
    for form, costs in report["batch_cost"].items():
        lines.append(
            f"- {form}: " + ", ".join(f"batch {b}: **{c:.2f}x**" for b, c in costs.items())
        )
    peer = report.get("llama_bench")
    if peer and "rounds" not in peer:  # a report from before the rounds: one pair
        lines += [
            "",
            f"llama.cpp, same file, same run: `llama-bench {peer['command']}`: "
            f"**{peer['tokens_per_s']:.1f} tok/s** (± {peer['stddev']:.1f}). forklift "
            f"{peer['forklift_form']} at batch 1: **{peer['ratio']:.2f}x** llama-bench.",
        ]
    elif peer:
        lines += [
            "",
            f"llama.cpp, same file, same run: `llama-bench {peer['command']}`, in "
            f"{len(peer['rounds'])} rounds that each time forklift {peer['forklift_form']}'s "
            f"single stream ({PEER_ROUND_STEPS} steps, median) and then llama-bench:",
            "",
            "| round | forklift (tok/s) | llama-bench (tok/s) | ratio |",
            "|---|---|---|---|",
            *(
                f"| {i + 1} | {r['forklift_tokens_per_s']:.1f} | {r['tokens_per_s']:.1f} "
                f"(± {r['stddev']:.1f}) | {r['ratio']:.2f}x |"
                for i, r in enumerate(peer["rounds"])
            ),
            "",
            f"forklift {peer['forklift_form']} at batch 1: **{peer['ratio']:.2f}x** llama-bench "
            "(the median of the rounds' ratios).",
        ]
    lines.append("")
    return "\n".join(lines)


def write_report(report: dict[str, Any], out_dir: Path) -> list[Path]:
    return write_report_files(report, out_dir, "decode", render_markdown, _plot)


def _plot(report: dict[str, Any]) -> Figure:
    fig, (left, right) = subplots(1, 2, figsize=(10, 4))
    forms = list(dict.fromkeys(p["form"] for p in report["points"]))
    for form in forms:
        points = [p for p in report["points"] if p["form"] == form]
        batches = [p["batch_size"] for p in points]
        left.plot(batches, [p["tokens_per_s"] for p in points], "o-", label=form)
        right.plot(batches, [100 * p["fraction_of_bandwidth"] for p in points], "o-", label=form)
    peer = report.get("llama_bench")
    if peer:
        left.axhline(peer["tokens_per_s"], color="grey", linestyle="--", label="llama-bench")
    left.set_ylabel("decoded tokens/s")
    left.set_title(f"Decode at context {report['settings']['context']}")
    left.legend()
    right.set_ylabel("% of measured read bandwidth")
    right.set_title("Bytes per step / step time")
    for axis in (left, right):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("batch size")
    return fig
