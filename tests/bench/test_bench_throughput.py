"""`forklift bench throughput --quick` end to end: structure and arithmetic of the report."""

from __future__ import annotations

import json

import pytest

from forklift.bench.workload import INSTRUCTIONS, offline_mixed
from forklift.cli import main


def test_offline_mixed_cycles_instructions_and_lengths():
    work = offline_mixed(34, (32, 64, 128, 512))
    assert len(INSTRUCTIONS) == 32
    assert [n for _, n in work[:5]] == [32, 64, 128, 512, 32]
    assert work[32][0] == INSTRUCTIONS[0]
    with pytest.raises(ValueError, match="num_requests"):
        offline_mixed(0)


@pytest.mark.slow
def test_quick_throughput_report(tmp_path):
    assert main(["bench", "throughput", "--quick", "--out-dir", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "throughput.json").read_text())
    assert (tmp_path / "throughput.md").read_text().startswith("# Offline throughput")
    assert (tmp_path / "throughput.png").stat().st_size > 0
    requested = report["workload"]["requested_output_tokens"]
    hf, fk = report["hf"], report["forklift"]
    # Every request completed with exactly its requested length on both sides.
    assert hf["per_request_output_tokens"] == requested
    assert fk["per_request_output_tokens"] == requested
    assert hf["output_tokens"] == fk["output_tokens"] == sum(requested)
    # Static batches of 4 run to their longest request: slots = 4 x 16 per batch.
    batch = hf["extra"]["batch_size"]
    expected_slots = sum(
        len(requested[i : i + batch]) * max(requested[i : i + batch])
        for i in range(0, len(requested), batch)
    )
    assert hf["extra"]["token_slots"] == expected_slots
    assert hf["extra"]["wasted_slots"] == expected_slots - sum(requested)
    assert hf["extra"]["waste_fraction"] == pytest.approx(1 - sum(requested) / expected_slots)
    for side in (hf, fk):
        assert side["output_tokens_per_s"] == pytest.approx(side["output_tokens"] / side["wall_s"])
    assert report["speedup"] == pytest.approx(fk["output_tokens_per_s"] / hf["output_tokens_per_s"])
    assert 1 <= fk["extra"]["mean_running_batch"] <= len(requested)
