"""What a benchmark script leaves in benchmarks/: its report as JSON and its table as
markdown, the table closed by the command that made it and this CPU's flags."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from revision_build import ROOT


def command_line(script: str, *arguments: object) -> str:
    """How to run `script` (a script's __file__) again; paths relative to the repository."""
    words = [str(a.relative_to(ROOT)) if isinstance(a, Path) else str(a) for a in arguments]
    return " ".join([".venv/bin/python", f"benchmarks/scripts/{Path(script).name}", *words])


def write_results(
    out_dir: Path, stem: str, report: dict[str, Any], lines: list[str], command: str
) -> None:
    """<stem>.json from `report` (which holds "cpu_flags") and <stem>.md from `lines` plus the
    command and the flags; the markdown is printed too."""
    (out_dir / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [*lines, f"Command: `{command}`", f"CPU flags: {' '.join(report['cpu_flags'])}"]
    (out_dir / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
