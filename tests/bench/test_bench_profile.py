"""`forklift bench profile`: operator buckets, and a small run end to end."""

from __future__ import annotations

import json
import time

import pytest
import torch
from tiny_models import make_tiny_model

from forklift.bench.step_profile import CATEGORIES, categorize, profile_decode
from forklift.cli import main
from forklift.llm import LLM
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


@pytest.mark.slow
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
        # The operators' own times fit inside the step's wall time.
        measured = [parts[c] for c in CATEGORIES if c != "python and dispatch"]
        assert sum(measured) <= breakdown["wall_ms_per_step"]


NAP_S = 0.05


@torch.library.custom_op("forklift_test::nap", mutates_args=())
def _nap(x: torch.Tensor) -> torch.Tensor:
    time.sleep(NAP_S)  # an operator of known length, in no named bucket
    return x.clone()


def test_buckets_match_known_operator_and_python_time(tmp_path, monkeypatch):
    """Each step gains a 50 ms operator and 50 ms of Python outside any operator: the first
    must land in "other ops" and the second in "python and dispatch", not the other way round,
    and both lie inside the step's wall time."""
    make_tiny_model("llama", tmp_path)
    llm = LLM(model=str(tmp_path), dtype="float32", max_model_len=128, kv_cache_memory_bytes=2**22)
    runner = llm.llm_engine.runner
    real_execute = runner.execute

    def execute(*args, **kwargs):
        torch.ops.forklift_test.nap(torch.zeros(1))
        result = real_execute(*args, **kwargs)
        time.sleep(NAP_S)
        return result

    monkeypatch.setattr(runner, "execute", execute)
    steps = 4
    breakdown = profile_decode(llm, 2, steps, context=8)
    parts, nap_ms = breakdown.ms_per_step, 1000 * NAP_S
    # The tiny model's own work is a few ms a step; allow it up to half a nap.
    assert nap_ms <= parts["other ops"] < 1.5 * nap_ms, parts
    assert nap_ms <= parts["python and dispatch"] < 1.5 * nap_ms, parts
    measured = [parts[c] for c in CATEGORIES if c != "python and dispatch"]
    assert sum(measured) + nap_ms <= breakdown.wall_ms_per_step
