"""KV-cache arithmetic, `forklift kv-calc` and `forklift bench memory`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny_models import make_tiny_model

from forklift.bench.kv_calc import budget_breakdown, kv_cache_bytes
from forklift.bench.memory.figures import seed_figures
from forklift.cli import main

SEED_SHAPE = ["--layers", "16", "--kv-heads", "4", "--head-dim", "256"]


def test_kv_cache_bytes_matches_the_seed_example():
    # 16 layers, 4 KV heads, head dim 256, 8192 tokens, bf16.
    assert kv_cache_bytes(16, 4, 256, 8192, 2) == 536_870_912


def test_kv_cache_bytes_rejects_non_positive_numbers():
    with pytest.raises(ValueError, match="num_layers"):
        kv_cache_bytes(0, 4, 256, 8192, 2)


def test_budget_breakdown_on_a_small_example():
    # 100 bytes per token, blocks of 4 -> 400 bytes per block; 10,000 bytes buy 25 blocks.
    b = budget_breakdown(10_000, 100, 4, 10)
    assert b.bytes_per_block == 400
    assert b.num_blocks == 25
    assert b.num_tokens == 100
    # A 10-token request needs ceil(10 / 4) = 3 blocks: 25 // 3 = 8 at once.
    assert b.blocks_per_request == 3
    assert b.num_requests == 8


def test_budget_breakdown_leftover_bytes_buy_nothing():
    b = budget_breakdown(799, 100, 4, 4)
    assert (b.num_blocks, b.num_tokens, b.num_requests) == (1, 4, 1)


def test_seed_figures_come_from_the_block_manager():
    f = seed_figures()
    assert (f.contiguous.reserved, f.contiguous.used, f.contiguous.unused) == (36, 10, 26)
    assert (f.paged.reserved, f.paged.used, f.paged.unused) == (16, 10, 6)
    assert f.freed_slots == 20


def test_kv_calc_prints_the_seed_example(capsys):
    assert main(["kv-calc", *SEED_SHAPE, "--tokens", "8192", "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "536870912" in out
    assert "2 x 16 x 4 x 256 x 8192 x 2" in out
    assert "512.00 MiB" in out


def test_kv_calc_counts_an_int8_caches_rows(capsys):
    """int8 rows: one byte a value plus a 4-byte scale, (256 + 4) / 512 of bf16's bytes."""
    args = ["kv-calc", *SEED_SHAPE, "--tokens", "8192", "--kv-cache-dtype", "int8",
            "--budget-gib", "1"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "2 x 16 x 4 x (256 + 4) x 8192 x 1" in out
    assert f"{2 * 16 * 4 * 260 * 8192}" in out
    assert f"tokens: {2**30 // (2 * 16 * 4 * 260 * 16) * 16:,}" in out


def test_kv_calc_counts_a_cache_dtype_of_its_own(capsys):
    """kv_cache_dtype bfloat16 under an fp32 model: two bytes a value, no scale."""
    args = ["kv-calc", *SEED_SHAPE, "--tokens", "8192", "--dtype", "float32",
            "--kv-cache-dtype", "bfloat16"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "2 x 16 x 4 x 256 x 8192 x 2" in out
    assert "536870912" in out


def test_kv_calc_budget_breakdown(capsys):
    args = ["kv-calc", *SEED_SHAPE, "--budget-gib", "1", "--block-size", "16"]
    assert main(args) == 0
    out = capsys.readouterr().out
    # 1 GiB / 65,536 bytes per token = 16,384 tokens = 1,024 blocks = 2 requests of 8,192.
    assert "1,024 blocks" in out
    assert "tokens: 16,384" in out
    assert "2 at once" in out


def test_kv_calc_reads_the_default_model(capsys):
    assert main(["kv-calc", "--tokens", "1"]) == 0
    out = capsys.readouterr().out
    # SmolLM2-135M: 30 layers, 3 KV heads, head dim 64.
    assert "2 x 30 x 3 x 64 x 1 x 2" in out


def test_kv_calc_counts_sliding_window_groups(capsys, tmp_path):
    # Tiny Gemma 3: a sliding (window 12) and a full layer, 2 KV heads x 16, fp32.
    make_tiny_model("gemma3", tmp_path)
    args = ["kv-calc", "--model", str(tmp_path), "--tokens", "64", "--dtype", "float32",
            "--block-size", "4", "--chunk", "8", "--budget-bytes", "65536"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "KV groups of 1 layers (1 full, 1 windowed)" in out
    # Full group: 16 blocks. Windowed: 11 positions back plus the step's tokens, one more
    # block boundary at worst: 4 blocks decoding, 6 while 8-token chunks run.
    assert "decoding: 20 blocks" in out
    assert "prefilling 8-token chunks: 22 blocks" in out
    # 65,536 bytes / (20 blocks x 4 tokens x 1 layer x 2 x 2 x 16 x 4 bytes) = 3 requests.
    assert "3 decoding requests at once" in out


def test_kv_calc_rejects_zero_layers(capsys):
    assert main(["kv-calc", "--layers", "0", "--kv-heads", "4", "--head-dim", "256"]) == 2
    err = capsys.readouterr().err
    assert "--layers must be > 0" in err
    assert "Traceback" not in err


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory) -> tuple[Path, dict]:
    out_dir = tmp_path_factory.mktemp("bench") / "out"
    assert main(["bench", "memory", "--quick", "--out-dir", str(out_dir)]) == 0
    return out_dir, json.loads((out_dir / "memory.json").read_text())


@pytest.mark.slow
def test_bench_memory_reproduces_the_seed_figures(quick_report):
    _, report = quick_report
    contiguous = report["figures"]["contiguous"]
    paged = report["figures"]["paged"]
    assert (contiguous["reserved"], contiguous["used"], contiguous["unused"]) == (36, 10, 26)
    assert contiguous["waste_percent"] == 72
    assert contiguous["waste_fraction"] == pytest.approx(26 / 36)
    assert (paged["reserved"], paged["used"], paged["unused"]) == (16, 10, 6)
    assert report["figures"]["freed_slots"] == 20


@pytest.mark.slow
def test_bench_memory_paging_fits_more_at_scale(quick_report):
    _, report = quick_report
    scale = report["at_scale"]
    assert scale["paged"]["requests_in_flight"] > scale["contiguous"]["requests_in_flight"]
    assert (
        scale["paged"]["slots"]["waste_fraction"] < scale["contiguous"]["slots"]["waste_fraction"]
    )
    assert scale["mean_request_len"] < scale["max_model_len"] / 2


@pytest.mark.slow
def test_bench_memory_measured_waste_is_under_one_block(quick_report):
    _, report = quick_report
    measured = report["measured"]
    block_size = measured["spec"]["block_size"]
    assert measured["num_steps"] > 0
    assert measured["max_waste_tokens"] < block_size
    assert measured["mean_waste_tokens"] < block_size
    assert measured["under_one_block"] is True
    assert measured["paged"]["waste_fraction"] < measured["contiguous"]["waste_fraction"]
    # Greedy with EOS ignored: every request produced exactly its output budget.
    assert measured["num_output_tokens"] == measured["requested_output_tokens"] > 0


@pytest.mark.slow
def test_bench_memory_writes_markdown_and_chart(quick_report):
    out_dir, _ = quick_report
    md = (out_dir / "memory.md").read_text()
    assert "forklift bench memory" in md.splitlines()[2]
    assert "| contiguous (max 12 each) | 36 | 10 | 26 | 72.2% |" in md
    png = (out_dir / "memory.png").read_bytes()
    assert png.startswith(b"\x89PNG")


# A Qwen3.5-family 27B hybrid shape: 64 layers, every fourth full attention.
SEED_HYBRID_CONFIG = {
    "architectures": ["Qwen3_5ForCausalLM"],
    "model_type": "qwen3_5_text",
    "vocab_size": 248320,
    "hidden_size": 5120,
    "intermediate_size": 17408,
    "num_hidden_layers": 64,
    "num_attention_heads": 24,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "full_attention_interval": 4,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 48,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000000,
        "partial_rotary_factor": 0.25,
    },
}


def test_kv_calc_reproduces_the_seed_example_from_a_hybrid_model(tmp_path, capsys):
    import json

    (tmp_path / "config.json").write_text(json.dumps(SEED_HYBRID_CONFIG))
    args = ["kv-calc", "--model", str(tmp_path), "--tokens", "8192", "--budget-gib", "8"]
    assert main(args) == 0
    out = capsys.readouterr().out
    # Only the 16 full-attention layers hold KV.
    assert "2 x 16 x 4 x 256 x 8192 x 2" in out
    assert "536870912" in out
    # 48 linear layers: conv 3 x (2 x 16 x 128 + 48 x 128) bf16 values, and a float32
    # 48 x 128 x 128 state each.
    assert "conv 48 x 30720 x 2" in out
    assert "recurrent 48 x 786432 x 4" in out
    assert f"{48 * (30720 * 2 + 786432 * 4):,} bytes" in out
    # 8 GiB: 16 requests of 8,192 tokens by KV alone; with the 147 MiB state each, 12.
    assert "16 at once" in out
    assert "with each request's linear-layer state: 12 requests at once" in out
    # Prefix caching's checkpoints: an eighth of 8 GiB in states of 147 MiB; each as large as
    # the K/V of 153,944,064 / 65,536 bytes per token.
    assert "up to 6 linear-layer state checkpoints, leaving room for 11 requests" in out
    assert "as many bytes as 2,349 tokens of K/V" in out
