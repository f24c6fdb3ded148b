"""`forklift bench prefix --quick` end to end: structure and arithmetic of the report."""

from __future__ import annotations

import json

import pytest

from forklift.cli import main


@pytest.mark.slow
def test_quick_prefix_report(tmp_path):
    assert main(["bench", "prefix", "--quick", "--out-dir", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "prefix.json").read_text())
    assert (tmp_path / "prefix.md").read_text().startswith("# Prefix caching")
    assert (tmp_path / "prefix.png").stat().st_size > 0
    settings = report["settings"]
    off, on = report["shared"]
    for run in (off, on):
        assert (
            run["per_request_output_tokens"]
            == [settings["shared_output_tokens"]] * (settings["shared_requests"])
        )
        assert run["prompt_tokens"] == sum(report["shared_prompt_tokens"])
        assert run["ttft_s_mean"] > 0
        assert run["output_tokens_per_s"] == pytest.approx(run["output_tokens"] / run["wall_s"])
    assert off["cached_prompt_tokens"] == 0
    # Every request after the first reuses the full blocks of the system prompt (16 tokens
    # each, the last one possibly not full).
    full_blocks = settings["system_prompt_tokens"] // 16 * 16 - 16
    assert on["cached_prompt_tokens"] >= (settings["shared_requests"] - 1) * full_blocks
    assert report["shared_speedup"] == pytest.approx(
        on["output_tokens_per_s"] / off["output_tokens_per_s"]
    )
    assert report["shared_ttft_ratio"] == pytest.approx(off["ttft_s_mean"] / on["ttft_s_mean"])
    solo, group, solo_cached = report["group"]
    samples = settings["group_prompts"] * settings["group_n"]
    for run in (solo, group, solo_cached):
        assert run["per_request_output_tokens"] == [settings["group_output_tokens"]] * samples
    assert group["peak_blocks"] < solo["peak_blocks"]
    assert report["group_block_ratio"] == pytest.approx(solo["peak_blocks"] / group["peak_blocks"])
