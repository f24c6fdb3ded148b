"""Writing a benchmark's results: `<name>.md`, `<name>.json` and `<name>.png` in one folder."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from forklift.config import cpu_flags as all_cpu_flags


def write_report_files(
    report: dict[str, Any],
    out_dir: Path,
    name: str,
    render_markdown: Callable[[dict[str, Any]], str],
    plot: Callable[[dict[str, Any], Path], None] | None,
) -> list[Path]:
    """Writes name.md, name.json and (when a picture helps) name.png."""
    out_dir.mkdir(parents=True, exist_ok=True)
    md_path, json_path, png_path = (out_dir / f"{name}.{ext}" for ext in ("md", "json", "png"))
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    md_path.write_text(render_markdown(report))
    if plot is None:
        return [md_path, json_path]
    plot(report, png_path)
    return [md_path, json_path, png_path]


def announce(paths: list[Path], markdown: str) -> None:
    """Tell the user where a report went, then show it."""
    for path in paths:
        print(f"wrote {path}")
    print(markdown)


def positive_ints(text: str, flag: str) -> tuple[int, ...]:
    """A comma-separated command-line list of positive integers, e.g. "1,8,32"."""
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated integers, got {text!r}") from None
    if min(values) < 1:
        raise ValueError(f"{flag} must be positive integers, got {text!r}")
    return values


def cpu_flags() -> list[str]:
    """The CPU's matrix-relevant instruction-set flags (benchmarks record them)."""
    return sorted(f for f in all_cpu_flags() if f.startswith(("avx", "amx", "fma")))
