"""Writing a benchmark's results: `<name>.md`, `<name>.json` and `<name>.png` in one folder.

Every benchmark goes through `write_report_files`. Charts need matplotlib, the `bench` extra:
it is imported only when a chart is drawn, so nothing else in forklift depends on it.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, is_dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypeVar

from forklift.cpu import cpu_flags as all_cpu_flags
from forklift.cpu import simulated_cpu_kind

# Marks a report measured under FORKLIFT_CPU_KIND (forklift/cpu.py).
SIMULATED_FLAG_PREFIX = "simulated:"

if TYPE_CHECKING:
    from matplotlib.figure import Figure

Report = TypeVar("Report")


def write_report_files(
    report: Report,
    out_dir: Path,
    name: str,
    render_markdown: Callable[[Report], str],
    plot: Callable[[Report], Figure] | None,
    dpi: int = 100,
) -> list[Path]:
    """Writes name.json, name.md and (when a picture helps) name.png from `plot`'s figure.

    `report` is a JSON-ready dict, or a dataclass written as its fields."""
    out_dir.mkdir(parents=True, exist_ok=True)
    md_path, json_path, png_path = (out_dir / f"{name}.{ext}" for ext in ("md", "json", "png"))
    data = asdict(report) if is_dataclass(report) else report
    json_path.write_text(json.dumps(data, indent=2) + "\n")
    md_path.write_text(render_markdown(report))
    if plot is None:
        return [md_path, json_path]
    figure = plot(report)
    figure.tight_layout()
    figure.savefig(png_path, dpi=dpi)
    _pyplot().close(figure)
    return [md_path, json_path, png_path]


def require_matplotlib() -> None:
    """Fails with the fix before a benchmark runs (some take an hour), not when it plots."""
    if importlib.util.find_spec("matplotlib") is None:
        raise ValueError("benchmark charts need matplotlib: pip install 'forklift[bench]'")


def subplots(*args: Any, **kwargs: Any) -> tuple[Figure, Any]:
    """`matplotlib.pyplot.subplots` on the file-only Agg backend (the writer sets the PNG's dpi)."""
    return _pyplot().subplots(*args, **kwargs)


def _pyplot() -> ModuleType:
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    """A markdown table's lines: the header, the rule, one line per row."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return lines


def cpu_flags() -> list[str]:
    """The CPU's matrix-relevant instruction-set flags (benchmarks record them), as the
    engine sees them; a simulated kind adds a last entry `simulated:KIND`."""
    flags = sorted(f for f in all_cpu_flags() if f.startswith(("avx", "amx", "fma")))
    kind = simulated_cpu_kind()
    return [*flags, f"{SIMULATED_FLAG_PREFIX}{kind}"] if kind else flags
