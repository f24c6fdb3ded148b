"""Every ratio the README quotes beside a link to a benchmark report (numbers like `1.57x`)
is one that report records, at the README's precision."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# A markdown link to a file or folder under benchmarks/.
LINK = re.compile(r"\]\((benchmarks/[^)\s]+)\)")
# A report or folder of reports named by itself in backticks, resolved in a linked folder.
NAMED = re.compile(r"`([\w./-]+(?:\.md|/))`")
# A ratio: `1.57x`, or either end of a range such as `0.31-0.38x` or `1.4x-1.7x`.
RATIO = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)(?:x\b|(?=-\d+(?:\.\d+)?x\b))")


def _items(text: str) -> list[str]:
    """The README's list items and paragraphs, each joined into one line."""
    blocks, current = [], []
    for line in text.splitlines():
        if line.startswith(("- ", "#")) or not line.strip():
            if current:
                blocks.append(" ".join(current))
            current = [] if not line.strip() or line.startswith("#") else [line]
        else:
            current.append(line.strip())
    if current:
        blocks.append(" ".join(current))
    return blocks


def _reports(item: str) -> list[Path]:
    reports = []
    for target in LINK.findall(item):
        path = ROOT / target.split("#")[0]
        assert path.exists(), f"the README links {target}, which is not in the repository"
        if not path.is_dir():
            reports.append(path)
            continue
        named = [path / name for name in NAMED.findall(item) if (path / name).exists()]
        for entry in named or [path]:
            reports += sorted(entry.glob("*.md")) if entry.is_dir() else [entry]
    return reports


def _quoted(item: str) -> list[str]:
    # Drop link targets and code spans (file names, commands), whose digits are no figures.
    prose = re.sub(r"\]\([^)]*\)|`[^`]*`", " ", item)
    return RATIO.findall(prose)


def _recorded(reports: list[Path]) -> set[float]:
    found = set()
    for report in reports:
        for number in re.findall(r"(\d+(?:\.\d+)?)x\b", report.read_text()):
            found.add(float(number))
    return found


def _matches(quoted: str, recorded: set[float]) -> bool:
    decimals = len(quoted.partition(".")[2])
    return any(round(value, decimals) == float(quoted) for value in recorded)


def _cases() -> list[tuple[str, str, list[Path]]]:
    cases = []
    for item in _items((ROOT / "README.md").read_text()):
        reports = _reports(item)
        if reports:
            for ratio in _quoted(item):
                cases.append((ratio, item, reports))
    return cases


def test_the_readme_quotes_ratios_beside_its_reports():
    assert len(_cases()) > 20


@pytest.mark.parametrize(("ratio", "item", "reports"), _cases(), ids=lambda v: str(v)[:40])
def test_each_quoted_ratio_is_in_the_linked_report(ratio, item, reports):
    names = [str(r.relative_to(ROOT)) for r in reports]
    assert _matches(ratio, _recorded(reports)), f"{ratio}x is in none of {names}: {item[:200]}"
