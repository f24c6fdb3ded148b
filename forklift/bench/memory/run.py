"""The whole of `forklift bench memory`: Parts A, B and C in one report (md, json, png)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from forklift.bench.memory.at_scale import ScaleResult, at_scale, scale_markdown
from forklift.bench.memory.figures import (
    FigureResult,
    check_seed_figures,
    figures_markdown,
    seed_figures,
)
from forklift.bench.memory.measured import (
    MeasuredResult,
    measure_run,
    measured_markdown,
    run_spec,
)
from forklift.bench.memory.slots import bar_panel
from forklift.bench.report import subplots, write_report_files
from forklift.checkpoint.source import resolve_model
from forklift.model.model_source import load_model_config

if TYPE_CHECKING:
    from matplotlib.figure import Figure


@dataclass(frozen=True)
class MemoryReport:
    command: str
    quick: bool
    figures: FigureResult
    at_scale: ScaleResult
    measured: MeasuredResult


def run_memory_bench(
    command: str, quick: bool, model: str | None, budget_gib: float | None
) -> MemoryReport:
    figures = seed_figures()
    check_seed_figures(figures)
    source = resolve_model(model)
    config = load_model_config(source)
    budget = int(budget_gib * 2**30) if budget_gib is not None else None
    scale = at_scale(config, source.path.name, budget)
    measured = measure_run(run_spec(quick), model, source.path.name, config)
    return MemoryReport(command, quick, figures, scale, measured)


def write_report(report: MemoryReport, out_dir: Path) -> list[Path]:
    return write_report_files(report, out_dir, "memory", render_markdown, plot, dpi=110)


def summary(report: MemoryReport) -> str:
    """The headline numbers, for the terminal."""
    f, s, m = report.figures, report.at_scale, report.measured
    return "\n".join(
        [
            f"three-request example: contiguous {f.contiguous.reserved} reserved / "
            f"{f.contiguous.used} used ({f.contiguous.waste_percent}% wasted); "
            f"paged {f.paged.reserved} / {f.paged.used}; {f.freed_slots} slots freed",
            f"at scale: {s.contiguous.requests_in_flight} requests in flight contiguous vs "
            f"{s.paged.requests_in_flight} paged ({s.gain:.1f}x)",
            f"measured: waste per request mean {m.mean_waste_tokens:.2f}, max "
            f"{m.max_waste_tokens} tokens (block size {m.spec.block_size}); overall "
            f"{100 * m.paged.waste_fraction:.1f}% paged vs "
            f"{100 * m.contiguous.waste_fraction:.1f}% contiguous",
        ]
    )


def render_markdown(report: MemoryReport) -> str:
    lines = [
        "# KV-cache memory: contiguous reservation vs paged blocks",
        "",
        f"Produced by `{report.command}`" + (" (quick mode)." if report.quick else "."),
        "",
        *figures_markdown(report.figures),
        *scale_markdown(report.at_scale),
        *measured_markdown(report.measured),
    ]
    return "\n".join(lines)


def plot(report: MemoryReport) -> Figure:
    f, s, m = report.figures, report.at_scale, report.measured
    panels = [
        ("A. Three-request example: slots", f.contiguous, f.paged, None),
        (
            f"B. At scale ({s.budget_tokens:,}-token budget): tokens",
            s.contiguous.slots,
            s.paged.slots,
            (s.contiguous.requests_in_flight, s.paged.requests_in_flight),
        ),
        (f"C. Measured run ({m.num_steps} steps): slot-steps", m.contiguous, m.paged, None),
    ]
    fig, axes = subplots(1, 3, figsize=(15, 4.8))
    for ax, (title, contiguous, paged, in_flight) in zip(axes, panels, strict=True):
        bar_panel(ax, title, contiguous, paged, in_flight)
    fig.suptitle("KV cache: reserved vs used, contiguous reservation vs paged blocks")
    return fig
