"""Every ratio the README and the benchmark index quote beside a link to a report (numbers
like `1.57x`) is one that report records, at the quoting precision; in a table row every
figure is (a row of the README's Performance table quotes forklift, the peer and the ratio
from the one report it links). The index lists every report under benchmarks/."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
# The documents that quote reports: the README, and the index of the reports.
DOCUMENTS = (ROOT / "README.md", BENCHMARKS / "README.md")
# A relative markdown link, its target up to an anchor.
LINK = re.compile(r"\]\(([^)\s#:]+)(?:#[^)\s]*)?\)")
# A report or folder of reports named by itself in backticks, resolved in a linked folder.
NAMED = re.compile(r"`([\w./-]+(?:\.md|/))`")
# A ratio: `1.57x`, or either end of a range such as `0.31-0.38x` or `1.4x-1.7x`.
RATIO = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)(?:x\b|(?=-\d+(?:\.\d+)?x\b))")
# A figure with decimals: `241.4`, `0.220`.
FIGURE = re.compile(r"(?<![\w.])(\d+\.\d+)(?![\w.]*\d)")


def _items(text: str) -> list[str]:
    """A document's list items, table rows and paragraphs, each joined into one line."""
    blocks, current = [], []
    for line in text.splitlines():
        if line.startswith(("- ", "#", "|")) or not line.strip():
            if current:
                blocks.append(" ".join(current))
            current = [line] if line.startswith("- ") else []
            if line.startswith("|"):
                blocks.append(line)
        else:
            current.append(line.strip())
    if current:
        blocks.append(" ".join(current))
    return blocks


def _links(item: str, document: Path) -> list[Path]:
    """The files and folders under benchmarks/ that an item links, as paths."""
    paths = []
    for target in LINK.findall(item):
        path = (document.parent / target).resolve()
        if path == BENCHMARKS or BENCHMARKS in path.parents:
            paths.append(path)
    return paths


def _reports(item: str, document: Path) -> list[Path]:
    reports = []
    for path in _links(item, document):
        name = path.relative_to(ROOT)
        where = document.relative_to(ROOT)
        assert path.exists(), f"{where} links {name}, which is not in the repository"
        if not path.is_dir():
            reports.append(path)
            continue
        named = [path / name for name in NAMED.findall(item) if (path / name).exists()]
        for entry in named or [path]:
            reports += sorted(entry.glob("*.md")) if entry.is_dir() else [entry]
    return reports


def _prose(item: str) -> str:
    # Drop link targets and code spans (file names, commands), whose digits are no figures.
    return re.sub(r"\]\([^)]*\)|`[^`]*`", " ", item)


def _recorded(reports: list[Path], pattern: str) -> set[float]:
    found = set()
    for report in reports:
        for number in re.findall(pattern, report.read_text()):
            found.add(float(number))
    return found


def _matches(quoted: str, recorded: set[float]) -> bool:
    decimals = len(quoted.partition(".")[2])
    return any(round(value, decimals) == float(quoted) for value in recorded)


def _quoting_items() -> list[tuple[Path, str, list[Path]]]:
    found = []
    for document in DOCUMENTS:
        for item in _items(document.read_text()):
            reports = _reports(item, document)
            if reports:
                found.append((document, item, reports))
    return found


def _ratio_cases() -> list[tuple[str, str, str, list[Path]]]:
    return [
        (str(document.relative_to(ROOT)), ratio, item, reports)
        for document, item, reports in _quoting_items()
        for ratio in RATIO.findall(_prose(item))
    ]


def _figure_cases() -> list[tuple[str, str, str, list[Path]]]:
    return [
        (str(document.relative_to(ROOT)), figure, item, reports)
        for document, item, reports in _quoting_items()
        if item.startswith("|")
        for figure in FIGURE.findall(_prose(item))
    ]


def _case_id(value) -> str:
    return str(value)[:40]


def test_the_documents_quote_ratios_beside_their_reports():
    quoted = [document for document, *_ in _ratio_cases()]
    assert quoted.count("README.md") > 15
    assert quoted.count("benchmarks/README.md") > 60


def test_the_readme_performance_table_quotes_a_report_on_every_row():
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Performance\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")][2:]
    assert len(rows) >= 8
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert len(cells) == 6, row
        assert len(_links(row, ROOT / "README.md")) == 1, row
        assert RATIO.findall(_prose(cells[3])), row


@pytest.mark.parametrize(("document", "ratio", "item", "reports"), _ratio_cases(), ids=_case_id)
def test_each_quoted_ratio_is_in_the_linked_report(document, ratio, item, reports):
    names = [str(r.relative_to(ROOT)) for r in reports]
    recorded = _recorded(reports, r"(\d+(?:\.\d+)?)x\b")
    assert _matches(ratio, recorded), f"{document}: {ratio}x is in none of {names}: {item[:200]}"


@pytest.mark.parametrize(("document", "figure", "item", "reports"), _figure_cases(), ids=_case_id)
def test_each_figure_in_a_table_row_is_in_the_linked_report(document, figure, item, reports):
    names = [str(r.relative_to(ROOT)) for r in reports]
    recorded = _recorded(reports, r"(?<![\w.])(\d+\.\d+)")
    assert _matches(figure, recorded), f"{document}: {figure} is in none of {names}: {item[:200]}"


def test_the_index_lists_every_report():
    index = BENCHMARKS / "README.md"
    linked = {path for item in _items(index.read_text()) for path in _links(item, index)}
    reports = {path for path in BENCHMARKS.rglob("*.md") if path != index}
    missing = sorted(str(path.relative_to(BENCHMARKS)) for path in reports - linked)
    assert not missing, f"benchmarks/README.md does not list {missing}"
