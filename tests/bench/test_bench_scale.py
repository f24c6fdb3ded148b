"""The all-reduce arithmetic of `forklift bench scale` and its report."""

from __future__ import annotations

import pytest

from forklift.bench.scale import (
    LINKS,
    MODELS,
    Link,
    allreduce_seconds,
    render_markdown,
    tp_step_comm,
)


def test_ring_allreduce_time():
    link = Link("test", bandwidth_bytes_per_s=1e9, latency_s=1e-5, note="")
    assert allreduce_seconds(1e6, 1, link) == 0.0
    # Two ranks: 2 steps, each half the message plus one latency.
    assert allreduce_seconds(1e6, 2, link) == pytest.approx(2 * (1e-5 + 0.5e-3))
    # Many ranks approach 2 x message / bandwidth, plus a latency per step.
    assert allreduce_seconds(1e6, 8, link) == pytest.approx(14 * (1e-5 + 1e6 / 8 / 1e9))


def test_step_traffic_of_the_default_model():
    nvlink, network = LINKS
    row = tp_step_comm(MODELS[0], network, batch=8)
    assert row["allreduces_per_step"] == 60
    assert row["message_bytes"] == 8 * 576 * 2
    # Each rank sends half of each message twice (reduce-scatter, all-gather) at TP=2.
    assert row["bytes_sent_per_rank_per_token"] == 60 * 576 * 2
    fast = tp_step_comm(MODELS[0], nvlink, batch=8)
    assert row["step_comm_ms"] > 5 * fast["step_comm_ms"]
    assert row["step_comm_ms"] == pytest.approx(
        60 * allreduce_seconds(8 * 576 * 2, 2, network) * 1e3
    )


def test_report_table():
    def level(c, tps):
        return {"concurrency": c, "output_tokens_per_s": tps, "ttft_ms_p50": 100.0}

    report = {
        "command": "forklift bench scale",
        "cores": 2,
        "settings": {"input_tokens": 128, "output_tokens": 64, "concurrencies": [1, 8]},
        "measured": [
            {
                "deployment": "one",
                "processes": 1,
                "threads_per_process": 2,
                "levels": [level(1, 10.0), level(8, 40.0)],
            },
            {
                "deployment": "DP=2",
                "processes": 2,
                "threads_per_process": 1,
                "levels": [level(1, 8.0), level(8, 50.0)],
            },
        ],  # fmt: skip
        "tp_comm": [tp_step_comm(MODELS[0], LINKS[0], 8)],
        "models": [{"name": m.name, "note": m.note} for m in MODELS],
        "links": [{"name": k.name, "note": k.note} for k in LINKS],
    }
    text = render_markdown(report)
    assert "| DP=2 | 2 x 1 | 8.0 | 50.0 | 100 | 1.25x |" in text
    assert "| one | 1 x 2 | 10.0 | 40.0 | 100 | 1.00x |" in text
