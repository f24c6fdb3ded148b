"""`forklift bench lora`: what LoRA adapters cost a decode step and a serving batch.

One engine with adapter slots serves every case, so the only difference between rows is
which adapter each request runs: the base alone, one adapter for every row, or four adapters
mixed across the batch (ranks 8, 16 and 64). Adapters are random PEFT directories written
for the model's shapes, adapting every projection (the costliest case, common for quality)
or only q and v (PEFT's default for Llama models). Cases are
measured in interleaved rounds and the median kept, so the machine's drift spreads over all
of them; the table gives each case's step time over the base's at the same batch size.
"""

from __future__ import annotations

import json
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file

from forklift.bench.decode import time_pure_decode
from forklift.bench.report import cpu_flags, subplots, write_report_files
from forklift.llm import LLM
from forklift.lora_request import LoRARequest
from forklift.model.lora import CONFIG_FILE, TARGET_OWNERS, WEIGHTS_FILE, target_shapes
from forklift.model.model_config import ModelConfig
from forklift.sampling_params import SamplingParams

if TYPE_CHECKING:
    from matplotlib.figure import Figure


@dataclass
class LoRABenchSettings:
    model: str | None = None
    batch_sizes: tuple[int, ...] = (1, 8, 16)
    ranks: tuple[int, ...] = (8, 16, 64)
    # Four adapters of this rank adapting q and v only (0: not measured).
    qv_rank: int = 16
    context: int = 128
    timed_steps: int = 8
    rounds: int = 3
    # The serving comparison: requests, concurrency and output tokens each.
    serve_requests: int = 32
    serve_concurrency: int = 8
    serve_tokens: int = 64

    @classmethod
    def quick(cls, **overrides: Any) -> LoRABenchSettings:
        return cls(**{"batch_sizes": (1, 4), "ranks": (8,), "qv_rank": 8, "context": 32,
                      "timed_steps": 3, "rounds": 1, "serve_requests": 4,
                      "serve_concurrency": 2, "serve_tokens": 8, **overrides})  # fmt: skip


ALL_TARGETS = tuple(TARGET_OWNERS)
QV_TARGETS = ("q_proj", "v_proj")


def write_random_adapter(
    directory: Path,
    config: ModelConfig,
    rank: int,
    seed: int,
    targets: tuple[str, ...] = ALL_TARGETS,
) -> Path:
    """A PEFT adapter directory adapting `targets`, with weights of the size a trained
    adapter has (its output moves by a few percent)."""
    directory.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    shapes = target_shapes(config)
    for layer in range(config.num_layers):
        for module in targets:
            fan_in, fan_out = shapes[module]
            prefix = f"base_model.model.model.layers.{layer}.{TARGET_OWNERS[module]}.{module}"
            a = torch.randn(rank, fan_in, generator=generator) / fan_in**0.5
            b = torch.randn(fan_out, rank, generator=generator) * 0.02
            tensors[f"{prefix}.lora_A.weight"] = a
            tensors[f"{prefix}.lora_B.weight"] = b
    save_file(tensors, str(directory / WEIGHTS_FILE))
    config_json = {"peft_type": "LORA", "r": rank, "lora_alpha": rank,
                   "target_modules": list(targets), "bias": "none"}  # fmt: skip
    (directory / CONFIG_FILE).write_text(json.dumps(config_json))
    return directory


@dataclass
class StepPoint:
    case: str  # "base", "1 adapter r16", "4 adapters r8", ...
    batch_size: int
    step_ms: float
    over_base: float = 0.0


def _cases(adapters: dict[str, list[LoRARequest]]) -> dict[str, list[LoRARequest | None]]:
    """Each case's adapters, request i running entry i % len (None: the base)."""
    cases: dict[str, list[LoRARequest | None]] = {"base": [None]}
    for kind, loras in adapters.items():
        if kind.endswith("all"):
            cases[f"1 adapter {kind}"] = [loras[0]]
        cases[f"4 adapters {kind}"] = list(loras)
    return cases


def _serve_rate(llm: LLM, settings: LoRABenchSettings, loras: list[LoRARequest | None]) -> float:
    """Output tok/s of `serve_requests` requests (adapters round-robin) at the concurrency."""
    rng = random.Random(7)
    vocab = llm.llm_engine.model_config.vocab_size
    prompts = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(settings.context)]}
               for _ in range(settings.serve_requests)]  # fmt: skip
    chosen = [loras[i % len(loras)] for i in range(len(prompts))]
    params = SamplingParams(temperature=0, max_tokens=settings.serve_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=chosen)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def run_lora_bench(settings: LoRABenchSettings) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="forklift-lora-bench-") as scratch:
        llm = LLM(settings.model, enable_lora=True, max_loras=4,
                  max_lora_rank=max(*settings.ranks, settings.qv_rank),
                  max_cpu_loras=4 * (len(settings.ranks) + 1),
                  max_num_seqs=max(*settings.batch_sizes, settings.serve_concurrency),
                  max_model_len=settings.context + settings.serve_tokens + 64)  # fmt: skip
        engine = llm.llm_engine
        config = engine.model_config
        kinds = [(f"r{rank} all", rank, ALL_TARGETS) for rank in settings.ranks]
        if settings.qv_rank:
            kinds.append((f"r{settings.qv_rank} q,v", settings.qv_rank, QV_TARGETS))
        adapters: dict[str, list[LoRARequest]] = {}
        next_id = 1
        for kind, rank, targets in kinds:
            adapters[kind] = []
            for i in range(4):
                name = f"{kind.replace(' ', '-').replace(',', '')}-{i}"
                path = write_random_adapter(Path(scratch) / name, config, rank, next_id, targets)
                adapters[kind].append(LoRARequest(name, next_id, str(path)))
                next_id += 1
        cases = _cases(adapters)
        samples: dict[tuple[str, int], list[float]] = {}
        for round_index in range(settings.rounds):
            for batch in settings.batch_sizes:
                for name, loras in cases.items():
                    rng = random.Random(1000 * round_index + batch)
                    steps = time_pure_decode(llm, batch, settings.context, settings.timed_steps,
                                             rng, lora_requests=loras)  # fmt: skip
                    samples.setdefault((name, batch), []).append(statistics.median(steps))
        points = [StepPoint(name, batch, 1000 * statistics.median(times))
                  for (name, batch), times in samples.items()]  # fmt: skip
        base = {p.batch_size: p.step_ms for p in points if p.case == "base"}
        for point in points:
            point.over_base = point.step_ms / base[point.batch_size]
        serve_kind = "r16 all" if "r16 all" in adapters else next(iter(adapters))
        llm.llm_engine.scheduler.max_num_seqs = settings.serve_concurrency
        mixed: list[LoRARequest | None] = list(adapters[serve_kind])
        serve_base = [_serve_rate(llm, settings, [None]) for _ in range(settings.rounds)]
        serve_mixed = [_serve_rate(llm, settings, mixed) for _ in range(settings.rounds)]
    serve = {
        "concurrency": settings.serve_concurrency,
        "adapters": serve_kind,
        "base_tokens_per_s": statistics.median(serve_base),
        "mixed_tokens_per_s": statistics.median(serve_mixed),
    }
    serve["mixed_over_base"] = serve["mixed_tokens_per_s"] / serve["base_tokens_per_s"]
    return {
        "benchmark": "lora",
        "model": engine.model_source.path.name,
        "threads": torch.get_num_threads(),
        "cpu_flags": cpu_flags(),
        "decode_path": engine.runner.decode_path,
        "settings": asdict(settings),
        "points": [asdict(p) for p in points],
        "serve": serve,
    }


def render_markdown(report: dict[str, Any]) -> str:
    settings = report["settings"]
    lines = [
        "# LoRA adapters: decode step and serving cost",
        "",
        f"Model `{report['model']}`, {report['threads']} threads, decode path "
        f"{report['decode_path']}; adapters on every projection (all) or q and v; prompts of "
        f"{settings['context']} tokens; median of {settings['rounds']} interleaved rounds of "
        f"{settings['timed_steps']} steps.",
        "",
        "| case | batch | step ms | over base |",
        "|---|---:|---:|---:|",
    ]
    for p in sorted(report["points"], key=lambda p: (p["batch_size"], p["case"] != "base")):
        lines.append(
            f"| {p['case']} | {p['batch_size']} | {p['step_ms']:.2f} | {p['over_base']:.2f}x |"
        )
    serve = report["serve"]
    lines += [
        "",
        f"Serving (offline, {settings['serve_requests']} requests at concurrency "
        f"{serve['concurrency']}, {settings['serve_tokens']} output tokens each): base "
        f"{serve['base_tokens_per_s']:.1f} output tok/s, four {serve['adapters']} adapters "
        f"round-robin {serve['mixed_tokens_per_s']:.1f} tok/s "
        f"({serve['mixed_over_base']:.2f}x).",
        "",
        f"CPU flags: {' '.join(report['cpu_flags'])}",
        "",
        f"Command: `{report.get('command', '')}`",
        "",
    ]
    return "\n".join(lines)


def _plot(report: dict[str, Any]) -> Figure:
    figure, axis = subplots(figsize=(7, 4))
    cases = list(dict.fromkeys(p["case"] for p in report["points"]))
    batches = sorted({p["batch_size"] for p in report["points"]})
    width = 0.8 / len(cases)
    for i, case in enumerate(cases):
        values = {p["batch_size"]: p["over_base"] for p in report["points"] if p["case"] == case}
        axis.bar([b + (i - len(cases) / 2) * width for b in range(len(batches))],
                 [values[b] for b in batches], width, label=case)  # fmt: skip
    axis.set_xticks(range(len(batches)), [f"batch {b}" for b in batches])
    axis.axhline(1.2, color="grey", linestyle="--", linewidth=1)
    axis.set_ylabel("decode step time / base")
    axis.legend(fontsize=7)
    return figure


def write_report(report: dict[str, Any], out_dir: Path) -> list[Path]:
    return write_report_files(report, out_dir, "lora", render_markdown, _plot)
