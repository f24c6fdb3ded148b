"""`forklift bench decode --quick` end to end, and the matrix-work arithmetic it rests on."""

from __future__ import annotations

import json

import pytest

from forklift.bench.decode import linear_weights
from forklift.cli import main


def test_linear_weights_count_every_projection_and_the_head(default_llm_fp32):
    engine = default_llm_fp32.llm_engine
    model = engine.runner.model
    projections = sum(p.numel() for n, p in model.named_parameters() if n.endswith("proj.weight"))
    config = engine.model_config
    assert linear_weights(config) == projections + config.vocab_size * config.hidden_size


def test_quick_decode_report(tmp_path):
    assert main(["bench", "decode", "--quick", "--out-dir", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "decode.json").read_text())
    assert (tmp_path / "decode.md").read_text().startswith("# Decode step time")
    assert (tmp_path / "decode.png").stat().st_size > 0
    points = report["points"]
    batches = list(report["settings"]["batch_sizes"])
    for mode in ("eager", "captured"):
        assert [p["batch_size"] for p in points if p["mode"] == mode] == batches
    step = {(p["mode"], p["batch_size"]): p["step_ms_median"] for p in points}
    assert report["speedup"] == {
        str(b): pytest.approx(step["eager", b] / step["captured", b]) for b in batches
    }
    assert "eager step time / captured step time" in (tmp_path / "decode.md").read_text()
    peak = report["gemm_peak_flops_per_s"]
    assert peak > 0
    for p in points:
        step_s = p["step_ms_median"] / 1000
        assert p["step_ms_min"] <= p["step_ms_median"]
        assert p["tokens_per_s"] == pytest.approx(p["batch_size"] / step_s)
        flops = 2 * report["linear_weights"] * p["batch_size"] / step_s
        assert p["matrix_flops_per_s"] == pytest.approx(flops)
        assert p["fraction_of_peak"] == pytest.approx(flops / peak)
    # A bigger batch gets more tokens out of each step.
    eager = [p for p in points if p["mode"] == "eager"]
    assert eager[-1]["tokens_per_s"] > eager[0]["tokens_per_s"]


def test_bad_lists_on_the_command_line_are_clear_errors(capsys):
    assert main(["bench", "decode", "--batch-sizes", "0,8"]) == 2
    assert "--batch-sizes must be positive integers" in capsys.readouterr().err
    assert main(["bench", "profile", "--batch-sizes", "1,x"]) == 2
    assert "--batch-sizes must be comma-separated integers" in capsys.readouterr().err
    assert main(["bench", "serve", "--concurrency", "-1"]) == 2
    assert "--concurrency must be positive" in capsys.readouterr().err
