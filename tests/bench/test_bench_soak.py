"""`forklift bench soak`: the request mix, the checks it applies, and a short run end to end."""

from __future__ import annotations

import json

import pytest

from forklift.bench.soak import (
    SoakRequest,
    SoakSettings,
    _check_usage,
    request_mix,
    rss_growth_after_warmup,
)
from forklift.cli import main


def test_the_mix_covers_every_kind_and_spreads_the_disconnects():
    mix = request_mix(SoakSettings(num_requests=400, disconnect_share=0.25))
    kinds = {(r.endpoint, r.stream, r.n, r.logprobs) for r in mix}
    assert len(kinds) == 16
    assert sum(r.disconnect for r in mix) == 50  # a quarter of the 200 streams
    assert not any(r.disconnect and not r.stream for r in mix)
    chat = next(r for r in mix if r.endpoint == "chat" and r.logprobs).body()
    assert chat["top_logprobs"] == 2 and "messages" in chat


def test_lengths_and_finish_reasons_are_checked():
    request = SoakRequest(0, "completions", False, 2, False, 4, False)
    assert _check_usage(request, {"completion_tokens": 8}, {0: "length", 1: "length"}).ok
    short = _check_usage(request, {"completion_tokens": 7}, {0: "length", 1: "length"})
    assert not short.ok and "expected 8" in short.error
    stopped = _check_usage(request, {"completion_tokens": 8}, {0: "length", 1: "stop"})
    assert not stopped.ok


def test_rss_growth_ignores_warm_up_and_sees_a_leak():
    flat = [{"rss_mib": 100 + (50 if i < 2 else 0)} for i in range(10)]
    assert rss_growth_after_warmup(flat) == 0
    leak = [{"rss_mib": 100 + 10 * i} for i in range(10)]
    assert rss_growth_after_warmup(leak) == 70


@pytest.mark.slow
def test_quick_soak_has_no_errors_and_frees_every_block(tmp_path):
    assert main(["bench", "soak", "--quick", "--out-dir", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "soak.json").read_text())
    assert report["requests"] == 48 and report["errors"] == 0
    assert report["disconnects"] == 4
    assert report["final_kv_usage"] == 0 and report["final_running"] == 0
    assert report["samples"] and (tmp_path / "soak.png").stat().st_size > 0
    assert "| 48 | 4 | 0 |" in (tmp_path / "soak.md").read_text()
