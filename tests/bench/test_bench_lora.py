"""`forklift bench lora --quick` end to end: every case measured at every batch size against
the base, the serving comparison, and the report files."""

from __future__ import annotations

import json

import pytest

from forklift.cli import main


@pytest.mark.slow
def test_quick_lora_bench(tmp_path):
    assert main(["bench", "lora", "--quick", "--out-dir", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "lora.json").read_text())
    assert (tmp_path / "lora.md").read_text().startswith("# LoRA adapters")
    assert (tmp_path / "lora.png").stat().st_size > 0
    settings = report["settings"]
    cases = {p["case"] for p in report["points"]}
    assert cases == {"base", "1 adapter r8 all", "4 adapters r8 all", "4 adapters r8 q,v"}
    for batch in settings["batch_sizes"]:
        row = {p["case"]: p for p in report["points"] if p["batch_size"] == batch}
        assert set(row) == cases
        assert row["base"]["over_base"] == 1.0
        assert all(p["step_ms"] > 0 for p in row.values())
    serve = report["serve"]
    assert serve["base_tokens_per_s"] > 0 and serve["mixed_tokens_per_s"] > 0
    assert report["command"] == "forklift bench lora --quick"
