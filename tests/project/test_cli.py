"""The command line on the default model."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest
from server_harness import forklift_command

from forklift.chat_session import run_chat
from forklift.config import EngineConfig
from forklift.sampling_params import SamplingParams

SMALL_ENGINE = ["--max-model-len", "512", "--kv-cache-memory-bytes", str(64 * 2**20)]


@pytest.mark.slow
def test_generate_answers_paris():
    result = subprocess.run(
        [
            *forklift_command(),
            "generate",
            "--prompt",
            # (Not "What is the capital of France?": its first token is a near-tie, 0.08
            # nats between "The" and "L" in fp32, that quantization may tip either way.)
            "Name the capital city of France.",
            "--temperature",
            "0",
            "--max-tokens",
            "24",
            *SMALL_ENGINE,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    # The startup log reports the KV cache.
    assert "KV cache:" in result.stderr


def assert_generate_exits_2_naming(flags: list[str], named: str) -> None:
    """`forklift generate` with bad flags: exit 2, the stderr names the field, no traceback."""
    result = subprocess.run(
        [*forklift_command(), "generate", "--prompt", "hi", *flags],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2
    assert named in result.stderr
    assert "Traceback" not in result.stderr


def test_generate_reports_bad_input_without_a_traceback():
    assert_generate_exits_2_naming(["--top-p", "3", *SMALL_ENGINE], "top_p")


@pytest.mark.slow
def test_chat_streams_replies_and_keeps_history(default_source):
    stdin = io.StringIO("Name the capital city of France.\nAnd of Italy?\n/exit\n")
    stdout = io.StringIO()
    config = EngineConfig(
        model=str(default_source.path), max_model_len=512, kv_cache_memory_bytes=64 * 2**20
    )
    code = run_chat(
        config, lambda: SamplingParams(temperature=0, max_tokens=24), None, stdin, stdout
    )
    assert code == 0
    transcript = stdout.getvalue()
    assert "Paris" in transcript
    assert "Rome" in transcript


def test_a_bad_speculative_config_exits_2_naming_the_key():
    bad = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_mx": 3}'
    assert_generate_exits_2_naming(["--speculative-config", bad], "prompt_lookup_mx")


def test_enforce_eager_flag_reaches_the_engine_config():
    import argparse

    from forklift.cli import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args([])).enforce_eager is None
    assert engine_config_from_args(parser.parse_args(["--enforce-eager"])).enforce_eager is True
    no_eager = parser.parse_args(["--no-enforce-eager"])
    assert engine_config_from_args(no_eager).enforce_eager is False


def test_prefix_caching_and_prefill_bound_flags_reach_the_engine_config():
    import argparse

    from forklift.cli import (
        SERVE_DECODE_STEP_PREFILL_TOKENS,
        add_engine_args,
        engine_config_from_args,
        serve_engine_config_from_args,
    )

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    default = engine_config_from_args(parser.parse_args([]))
    assert default.enable_prefix_caching is True
    # No bound by default offline (vLLM's chunked prefill); serve bounds a decoding step's
    # prefill where every step is one forward, unless told otherwise.
    assert default.resolve_decode_step_prefill_tokens() is None
    serve = serve_engine_config_from_args(parser.parse_args([]))
    assert serve.resolve_decode_step_prefill_tokens() == SERVE_DECODE_STEP_PREFILL_TOKENS
    split = serve_engine_config_from_args(parser.parse_args(["--no-batch-invariant"]))
    assert split.resolve_decode_step_prefill_tokens() is None
    unbounded = parser.parse_args(["--decode-step-prefill-tokens", "0"])
    assert serve_engine_config_from_args(unbounded).resolve_decode_step_prefill_tokens() is None
    off = parser.parse_args(["--no-enable-prefix-caching", "--decode-step-prefill-tokens", "0"])
    assert engine_config_from_args(off).enable_prefix_caching is False
    assert engine_config_from_args(off).resolve_decode_step_prefill_tokens() is None
    bounded = parser.parse_args(["--decode-step-prefill-tokens", "48"])
    assert engine_config_from_args(bounded).resolve_decode_step_prefill_tokens() == 48
    with pytest.raises(ValueError, match="decode_step_prefill_tokens"):
        engine_config_from_args(parser.parse_args(["--decode-step-prefill-tokens", "-3"]))


def test_prefill_pace_is_off_unless_asked_for():
    import argparse

    from forklift.cli import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args([])).resolve_prefill_pace_steps() is None
    off = parser.parse_args(["--prefill-pace-steps", "0"])
    assert engine_config_from_args(off).resolve_prefill_pace_steps() is None
    paced = parser.parse_args(["--prefill-pace-steps", "8"])
    assert engine_config_from_args(paced).resolve_prefill_pace_steps() == 8
    with pytest.raises(ValueError, match="prefill_pace_steps"):
        engine_config_from_args(parser.parse_args(["--prefill-pace-steps", "-1"]))


def test_a_charting_benchmark_without_matplotlib_names_the_extra(monkeypatch, tmp_path, capsys):
    from forklift.cli import main

    # None in sys.modules: the import system reports matplotlib as not installed.
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["bench", "memory", "--quick", "--out-dir", str(tmp_path)]) == 2
    assert "pip install 'forklift[bench]'" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
