"""`forklift bench decode --quick` end to end, and the matrix-work arithmetic it rests on."""

from __future__ import annotations

import json

import pytest

from forklift.bench.decode import linear_weights
from forklift.bench.report import SIMULATED_FLAG_PREFIX
from forklift.cli import main
from forklift.cpu import simulated_cpu_kind


def test_linear_weights_count_every_projection_and_the_head(default_llm_fp32):
    engine = default_llm_fp32.llm_engine
    model = engine.runner.model
    projections = sum(p.numel() for n, p in model.named_parameters() if n.endswith("proj.weight"))
    config = engine.model_config
    assert linear_weights(config) == projections + config.vocab_size * config.hidden_size


def test_quick_decode_report(tmp_path):
    assert main(["bench", "decode", "--quick", "--out-dir", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "decode.json").read_text())
    markdown = (tmp_path / "decode.md").read_text()
    assert markdown.startswith("# Decode step time by weight form")
    assert (tmp_path / "decode.png").stat().st_size > 0
    flags = report["cpu_flags"]
    kind = simulated_cpu_kind()
    if kind:  # a report measured under a simulated kind says so
        assert flags[-1] == f"{SIMULATED_FLAG_PREFIX}{kind}"
        flags = flags[:-1]
    assert flags and all(f.startswith(("avx", "amx", "fma")) for f in flags)
    points = report["points"]
    batches = list(report["settings"]["batch_sizes"])
    for form in ("bf16", "int4"):
        assert [p["batch_size"] for p in points if p["form"] == form] == batches
    step = {(p["form"], p["batch_size"]): p["step_ms_median"] for p in points}
    assert report["batch_cost"]["int4"] == {
        str(b): pytest.approx(step["int4", b] / step["int4", 1]) for b in batches
    }
    bandwidth = report["read_bandwidth_bytes_per_s"]
    assert bandwidth > 0
    weights = {(p["form"], p["batch_size"]): p["weight_bytes"] for p in points}
    # int4 decode reads well under half the bytes of the bf16 weights.
    assert weights["int4", 1] < 0.5 * weights["bf16", 1]
    for p in points:
        step_s = p["step_ms_median"] / 1000
        assert p["step_ms_min"] <= p["step_ms_median"]
        assert p["tokens_per_s"] == pytest.approx(p["batch_size"] / step_s)
        assert p["fraction_of_bandwidth"] == pytest.approx(
            (p["weight_bytes"] + p["kv_bytes"]) / step_s / bandwidth
        )
    # KV bytes grow with the batch: every sequence reads its own context.
    kv = [p["kv_bytes"] for p in points if p["form"] == "int4"]
    assert kv[-1] == kv[0] * batches[-1]


def test_unknown_weight_form_is_a_clear_error(capsys):
    assert main(["bench", "decode", "--forms", "int3"]) == 2
    assert "unknown weight form(s) int3" in capsys.readouterr().err


def test_bad_lists_on_the_command_line_are_clear_errors(capsys):
    assert main(["bench", "decode", "--batch-sizes", "0,8"]) == 2
    assert "--batch-sizes must be positive integers" in capsys.readouterr().err
    assert main(["bench", "profile", "--batch-sizes", "1,x"]) == 2
    assert "--batch-sizes must be comma-separated integers" in capsys.readouterr().err
    assert main(["bench", "serve", "--concurrency", "-1"]) == 2
    assert "--concurrency must be positive" in capsys.readouterr().err
