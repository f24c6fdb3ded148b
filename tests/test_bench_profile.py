"""`forklift bench profile`: operator buckets, and a small run end to end."""

from __future__ import annotations

import json

import pytest

from forklift.bench.step_profile import CATEGORIES, categorize
from forklift.cli import main
from forklift.native import build as native_build


def test_operators_fall_into_their_buckets():
    assert categorize("aten::mm") == categorize("mkldnn::_linear_pointwise") == "matrix"
    assert categorize("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention"
    assert categorize("aten::index_select") == "attention"
    assert categorize("aten::argmax") == categorize("aten::max") == "sampling"  # greedy picks
    assert categorize("forklift::native_seeded_sample") == "sampling"
    assert categorize("aten::silu") == "other ops"
    assert categorize("aten::_weight_int4pack_mm_for_cpu") == "matrix"
    # The in-place decode attention kernel is the compiled graph of an eager step.
    assert categorize("## Call CompiledFxGraph abc123 ##") == "attention"


def test_profile_report_adds_up(tmp_path):
    args = ["bench", "profile", "--batch-sizes", "1,4", "--steps", "2", "--context", "40"]
    assert main([*args, "--out-dir", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "profile.json").read_text())
    assert (tmp_path / "profile.png").stat().st_size > 0
    assert [b["batch_size"] for b in report["breakdowns"]] == [1, 4]
    for breakdown in report["breakdowns"]:
        parts = breakdown["ms_per_step"]
        assert list(parts) == list(CATEGORIES)
        assert all(value >= 0 for value in parts.values())
        assert parts["matrix"] > 0
        if native_build.find_compiler() is not None:
            assert parts["sampling"] > 0  # the native sampler's named call
        # The buckets account for the whole step.
        assert sum(parts.values()) == pytest.approx(breakdown["wall_ms_per_step"], rel=1e-6)
