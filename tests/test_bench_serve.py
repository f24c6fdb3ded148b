"""`forklift bench serve`: exact synthetic prompts, and the --quick sweep end to end."""

from __future__ import annotations

import json

import pytest

from forklift.bench.serve import ServeSettings
from forklift.bench.synthetic_prompt import synthetic_prompt
from forklift.cli import main
from forklift.tokenizer import load_tokenizer


def test_synthetic_prompts_have_exact_lengths_and_no_shared_prefix(default_source):
    tokenizer = load_tokenizer(default_source)
    prompts = [synthetic_prompt(tokenizer, 564, seed) for seed in range(12)]
    for prompt in prompts:
        assert len(tokenizer.encode(prompt, add_special_tokens=False)) == 564
    firsts = {tuple(tokenizer.encode(p, add_special_tokens=False)[:4]) for p in prompts}
    assert len(firsts) == len(prompts)
    with pytest.raises(ValueError, match="num_tokens"):
        synthetic_prompt(tokenizer, 1, 0)


def test_requests_per_level_follow_the_rule():
    settings = ServeSettings()
    assert [settings.requests_at(c) for c in settings.concurrencies] == [8, 16, 32, 64, 128]
    with pytest.raises(ValueError, match="endpoint"):
        ServeSettings(endpoint="embeddings").validate()


def test_quick_serve_sweep_against_a_started_server(tmp_path):
    assert main(["bench", "serve", "--quick", "--out-dir", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "serve.json").read_text())
    assert (tmp_path / "serve.md").read_text().startswith("# Serving sweep")
    assert (tmp_path / "serve.png").stat().st_size > 0
    assert report["command"] == "forklift bench serve --quick"
    work = report["workload"]
    levels = report["levels"]
    assert [lv["concurrency"] for lv in levels] == work["concurrencies"]
    for level, expected in zip(levels, work["requests_per_level"], strict=True):
        assert level["num_requests"] == level["completed"] == expected
        assert level["errors"] == []
        # The server counted exactly the prompt we built, and every request ran to length.
        assert level["prompt_tokens"] == [work["input_tokens"]]
        assert level["per_request_output_tokens"] == [work["output_tokens"]] * expected
        assert level["output_tokens"] == expected * work["output_tokens"]
        assert level["output_tokens_per_s"] == pytest.approx(
            level["output_tokens"] / level["wall_s"]
        )
        assert 0 < level["ttft_ms_p50"] <= level["ttft_ms_p99"]
        assert 0 < level["itl_ms_p50"] <= level["itl_ms_p99"]
        assert level["e2e_s_p50"] <= level["e2e_s_p99"] <= level["wall_s"]
        assert level["scaling"] == pytest.approx(
            level["output_tokens_per_s"] / levels[0]["output_tokens_per_s"]
        )
