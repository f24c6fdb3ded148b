"""`forklift bench decode --quick` end to end, and the matrix-work arithmetic it rests on."""

from __future__ import annotations

import json
import statistics

import pytest

from forklift.bench.decode import DecodeSettings, linear_weights, render_markdown, run_decode_bench
from forklift.bench.report import SIMULATED_FLAG_PREFIX
from forklift.cli import main
from forklift.cpu import simulated_cpu_kind


def test_linear_weights_count_every_projection_and_the_head(default_llm_fp32):
    engine = default_llm_fp32.llm_engine
    model = engine.runner.model
    projections = sum(p.numel() for n, p in model.named_parameters() if n.endswith("proj.weight"))
    config = engine.model_config
    assert linear_weights(config) == projections + config.vocab_size * config.hidden_size


@pytest.mark.slow
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


@pytest.mark.slow
def test_rounds_against_llama_bench_alternate_and_take_the_median_ratio(tmp_path):
    # A stand-in llama-bench: it logs each call and reports 50, 100, 200 tok/s in turn.
    calls = tmp_path / "calls"
    fake = tmp_path / "llama-bench"
    fake.write_text(
        "#!/bin/sh\n"
        f'echo "$@" >> {calls}\n'
        f"n=$(wc -l < {calls})\n"
        "rate=$((50 * (1 << (n - 1))))\n"
        'echo "[{\\"avg_ts\\": $rate, \\"stddev_ts\\": 1.5}]"\n'
    )
    fake.chmod(0o755)
    settings = DecodeSettings.quick(
        forms=("int4",), batch_sizes=(1,), llama_bench=str(fake), peer_rounds=3
    )
    peer = run_decode_bench(settings)["llama_bench"]
    lines = calls.read_text().splitlines()
    assert len(lines) == 3
    assert "-d 64" in lines[0] and "-fa 0" in lines[0]
    assert [r["tokens_per_s"] for r in peer["rounds"]] == [50, 100, 200]
    for r in peer["rounds"]:
        assert r["ratio"] == pytest.approx(r["forklift_tokens_per_s"] / r["tokens_per_s"])
    assert peer["ratio"] == pytest.approx(statistics.median(r["ratio"] for r in peer["rounds"]))
    assert peer["tokens_per_s"] == 100 and peer["forklift_form"] == "int4"
    assert peer["command"].startswith("-m SmolLM2")  # the file's name, not its path
    markdown = render_markdown({**_report_shell(settings), "llama_bench": peer})
    assert "| 3 |" in markdown and f"**{peer['ratio']:.2f}x** llama-bench" in markdown


def _report_shell(settings: DecodeSettings) -> dict:
    return {"command": "forklift bench decode", "model": "m", "threads": 2, "cpu_flags": [],
            "settings": {"context": settings.context, "timed_steps": settings.timed_steps},
            "read_bandwidth_bytes_per_s": 1e9, "points": [], "batch_cost": {}}  # fmt: skip


def test_peer_rounds_must_be_positive(capsys):
    with pytest.raises(ValueError, match="peer_rounds"):
        DecodeSettings(peer_rounds=0)
    assert main(["bench", "decode", "--peer-rounds", "0"]) == 2
    assert "--peer-rounds must be positive" in capsys.readouterr().err


def test_a_report_from_before_the_rounds_still_renders():
    peer = {"command": "-m m.gguf", "tokens_per_s": 100.0, "stddev": 2.0,
            "forklift_form": "int4", "ratio": 1.25}  # fmt: skip
    markdown = render_markdown({**_report_shell(DecodeSettings.quick()), "llama_bench": peer})
    assert "**100.0 tok/s** (± 2.0)" in markdown and "**1.25x** llama-bench" in markdown
