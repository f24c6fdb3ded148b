"""`forklift bench hybrid --quick`: both models measured in one run, ratios reported."""

from __future__ import annotations

import json

import pytest

from forklift.cli import main


@pytest.mark.slow
def test_quick_hybrid_bench_writes_both_models_and_their_ratios(tmp_path, capsys):
    assert main(["bench", "hybrid", "--quick", "--out-dir", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "hybrid.json").read_text())
    assert {p["model"] for p in report["points"]} == {"hybrid", "attention"}
    assert all(p["decode_tokens_per_s"] > 0 and p["prefill_tokens_per_s"] > 0
               for p in report["points"])  # fmt: skip
    # The toy hybrid has one full-attention layer of four: its cache per sequence at 64
    # tokens is a quarter of the twin's KV plus the linear layers' fixed state.
    (row_b1, _) = report["ratios"]
    assert 0.25 < row_b1["cache_bytes"] < 1
    assert report["command"] == "forklift bench hybrid --quick"
    assert "| hybrid | float32 | 64 | 1 |" in (tmp_path / "hybrid.md").read_text()
