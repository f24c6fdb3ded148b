"""Writing a benchmark's results: `<name>.md`, `<name>.json` and `<name>.png` in one folder."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any


def write_report_files(
    report: dict[str, Any],
    out_dir: Path,
    name: str,
    render_markdown: Callable[[dict[str, Any]], str],
    plot: Callable[[dict[str, Any], Path], None],
) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    md_path, json_path, png_path = (out_dir / f"{name}.{ext}" for ext in ("md", "json", "png"))
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    md_path.write_text(render_markdown(report))
    plot(report, png_path)
    return [md_path, json_path, png_path]
