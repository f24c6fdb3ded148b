"""`forklift bench structured --quick`: both modes measured in one run, ratios reported."""

from __future__ import annotations

import json

import pytest

from forklift.cli import main


@pytest.mark.slow
def test_quick_structured_bench_measures_both_modes(tmp_path):
    assert main(["bench", "structured", "--quick", "--out-dir", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "structured.json").read_text())
    points = report["points"]
    assert {(p["mode"], p["batch_size"]) for p in points} == {
        (mode, batch) for mode in ("plain", "json_schema") for batch in (1, 2)
    }
    assert all(p["decode_step_ms"] > 0 and p["output_tokens_per_s"] > 0 for p in points)
    assert [r["batch_size"] for r in report["ratios"]] == [1, 2]
    assert report["command"] == "forklift bench structured --quick"
    assert "| json_schema | 2 |" in (tmp_path / "structured.md").read_text()
