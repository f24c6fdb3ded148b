"""`forklift bench structured`: what a JSON-schema constraint costs, side by side in one run.

The same prompts run unconstrained and under a JSON schema, alternating, at each batch size.
The headline is the median pure-decode step (every request decoding one token), which
carries the whole per-token cost of a constraint (a mask per row, the mask applied to the
logits, the matcher advanced) and does not depend on how long the outputs come out.
Output tokens per second over whole runs are reported beside it.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from forklift.bench.report import cpu_flags, write_report_files
from forklift.llm import LLM
from forklift.sampling_params import SamplingParams
from forklift.structured.params import StructuredOutputsParams

# Open-ended (no maxItems), so a run decodes up to its token budget under the constraint too.
CATALOGUE = {
    "type": "object",
    "properties": {
        "products": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 24},
                    "price": {"type": "integer", "minimum": 1, "maximum": 1000},
                    "colour": {"enum": ["red", "green", "blue", "black", "white"]},
                    "in_stock": {"type": "boolean"},
                },
                "required": ["name", "price", "colour", "in_stock"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["products"],
    "additionalProperties": False,
}
QUESTION = "List twenty products of a small shop as JSON, with name, price, colour and stock."


@dataclass
class StructuredSettings:
    model: str | None = None  # the default model
    batch_sizes: tuple[int, ...] = (1, 8)
    max_tokens: int = 128
    repeats: int = 3

    @classmethod
    def quick(cls, **overrides: Any) -> StructuredSettings:
        return cls(**{"batch_sizes": (1, 2), "max_tokens": 12, "repeats": 1, **overrides})


@dataclass
class StructuredPoint:
    mode: str  # "plain" or "json_schema"
    batch_size: int
    decode_step_ms: float  # median pure-decode step
    output_tokens_per_s: float
    output_tokens: int
    valid_json: int  # outputs that parse (json_schema runs that finished)


def run_structured_bench(settings: StructuredSettings) -> dict[str, Any]:
    llm = LLM(model=settings.model, max_model_len=1024)
    prompt = [{"role": "user", "content": QUESTION}]
    modes = {
        "plain": SamplingParams(temperature=0, max_tokens=settings.max_tokens, ignore_eos=True),
        "json_schema": SamplingParams(
            temperature=0,
            max_tokens=settings.max_tokens,
            structured_outputs=StructuredOutputsParams(json=CATALOGUE),
        ),
    }
    llm.chat([prompt], modes["json_schema"].clone(max_tokens=2), use_tqdm=False)  # warm-up
    points = []
    for batch in settings.batch_sizes:
        runs: dict[str, list[tuple[list[float], int, float, int]]] = {m: [] for m in modes}
        for _ in range(settings.repeats):
            for mode, params in modes.items():  # alternating, so drift hits both alike
                runs[mode].append(_one_run(llm, [prompt] * batch, params, batch))
        for mode, results in runs.items():
            steps = [ms for r in results for ms in r[0]]
            tokens = sum(r[1] for r in results)
            seconds = sum(r[2] for r in results)
            points.append(
                StructuredPoint(
                    mode,
                    batch,
                    statistics.median(steps) if steps else float("nan"),
                    tokens / seconds,
                    tokens,
                    sum(r[3] for r in results),
                )
            )
    return {
        "cpu_flags": cpu_flags(),
        "threads": torch.get_num_threads(),
        "settings": asdict(settings),
        "points": [asdict(p) for p in points],
        "ratios": ratios(points),
    }


def _one_run(
    llm: LLM, prompts: list[Any], params: SamplingParams, batch: int
) -> tuple[list[float], int, float, int]:
    """(pure-decode step ms, output tokens, seconds, outputs that parse as JSON)."""
    engine = llm.llm_engine
    first = engine.step_log[-1].index if engine.step_log else 0
    started = time.perf_counter()
    outputs = llm.chat(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    steps = [
        s.duration_s * 1e3
        for s in engine.step_log
        if s.index > first and s.num_batched_tokens == batch and s.num_sampled == batch
    ]
    tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    valid = sum(_parses(c.text) for o in outputs for c in o.outputs)
    return steps, tokens, seconds, valid


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def ratios(points: list[StructuredPoint]) -> list[dict[str, Any]]:
    """Constrained over plain per batch size: the step's cost, and throughput kept."""
    plain = {p.batch_size: p for p in points if p.mode == "plain"}
    return [
        {
            "batch_size": p.batch_size,
            "decode_step": p.decode_step_ms / plain[p.batch_size].decode_step_ms,
            "output_tokens_per_s": p.output_tokens_per_s / plain[p.batch_size].output_tokens_per_s,
        }
        for p in points
        if p.mode == "json_schema" and p.batch_size in plain
    ]


def render_markdown(report: dict[str, Any]) -> str:
    settings = report["settings"]
    lines = [
        "# Structured outputs: a JSON schema against free text",
        "",
        f"Command: `{report['command']}`",
        "",
        f"{report['threads']} threads, CPU flags: {' '.join(report['cpu_flags']) or 'n/a'}. "
        f"Model: {settings['model'] or 'the default model'}; greedy, up to "
        f"{settings['max_tokens']} output tokens per request, {settings['repeats']} "
        "alternating runs per mode and batch size. The schema is an open-ended product list "
        "(nested objects, integer ranges, enums, booleans), so constrained runs also decode "
        "their whole budget and stop mid-list (none parse: that is by design, the rows "
        "compare equal work). The decode step is the median step in which every request "
        "decodes one token.",
        "",
        "| mode | batch | decode step (ms) | output tok/s | output tokens | outputs that parse |",
        "|---|---|---|---|---|---|",
    ]
    for p in report["points"]:
        lines.append(
            f"| {p['mode']} | {p['batch_size']} | {p['decode_step_ms']:.1f} | "
            f"{p['output_tokens_per_s']:.1f} | {p['output_tokens']} | {p['valid_json']} |"
        )
    lines += [
        "",
        "Constrained over plain: a decode step above 1 is the constraint's cost.",
        "",
        "| batch | decode step | output tok/s |",
        "|---|---|---|",
    ]
    for r in report["ratios"]:
        lines.append(
            f"| {r['batch_size']} | {r['decode_step']:.3f}x | {r['output_tokens_per_s']:.3f}x |"
        )
    return "\n".join(lines) + "\n"


def write_report(report: dict[str, Any], out_dir: Path) -> list[Path]:
    return write_report_files(report, out_dir, "structured", render_markdown, None)
