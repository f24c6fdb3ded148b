"""Speculation with a draft model: a second tiny model, or the target's own first layers.
Outputs are those of decoding without speculation, token for token, whatever the draft
guesses; a draft that is the target itself guesses right nearly always, which shows its K/V
follow the target's blocks through chunked prefill, preemption, forks and prefix hits."""

from __future__ import annotations

import json

import pytest
from test_engine import BLOCK_BYTES, make_llm
from test_spec_decode_engine import (
    abort_every_other,
    assert_no_leaks,
    assert_same,
    prompts_of,
    run,
)
from tiny_models import make_tiny_model

from forklift import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=40, ignore_eos=True, seed=11,
                        logprobs=2)  # fmt: skip
# The tiny target has 2 layers: all of them make a draft that is the target (which the
# adaptive rule would never let draft: it costs a whole step).
ITSELF = {"method": "draft_model", "draft_layers": 2, "num_speculative_tokens": 4,
          "adaptive_draft_length": False}  # fmt: skip


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-target")
    make_tiny_model("llama", directory)
    return directory


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-draft")
    make_tiny_model("llama", directory, seed=1)
    return directory


def acceptance(llm) -> float:
    stats = llm.llm_engine.spec_stats
    assert stats.num_draft_tokens > 0
    return stats.num_accepted_tokens / stats.num_draft_tokens


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_draft_that_is_the_target_is_accepted_and_changes_nothing(tiny_dir, params):
    prompts = prompts_of(6, seed=1)
    expected = run(make_llm(tiny_dir), prompts, params)
    llm = make_llm(tiny_dir, speculative_config=ITSELF)
    assert_same(run(llm, prompts, params), expected, logprobs=params.logprobs is not None)
    if params.temperature == 0:
        assert acceptance(llm) > 0.95
    else:  # a greedy guess stands where the target's draw picks it (rarely: near-even logits)
        assert llm.llm_engine.spec_stats.num_accepted_tokens > 0
    assert_no_leaks(llm)
    assert llm.llm_engine.proposer._progress == {}  # every finished request forgotten


@pytest.mark.parametrize(
    "spec",
    [
        {
            "method": "draft_model",
            "draft_layers": 1,
            "num_speculative_tokens": 3,
            "adaptive_draft_length": False,
        },  # fmt: skip
        "other",
    ],
    ids=["first-layer", "other-model"],
)
def test_poor_drafts_change_no_token(tiny_dir, other_draft, spec):
    if spec == "other":  # vLLM's spelling: a draft model's name alone picks the method
        spec = {"model": str(other_draft), "num_speculative_tokens": 3,
                "adaptive_draft_length": False}  # fmt: skip
    prompts = prompts_of(6, seed=2)
    for params in (GREEDY, SEEDED):
        expected = run(make_llm(tiny_dir), prompts, params)
        llm = make_llm(tiny_dir, speculative_config=spec)
        assert_same(run(llm, prompts, params), expected)
        assert llm.llm_engine.spec_stats.num_drafts > 0
        assert_no_leaks(llm)


@pytest.mark.parametrize(
    "situation",
    [
        dict(max_num_batched_tokens=16, decode_step_prefill_tokens=8),  # chunked prefill
        # preemption: the draft's K/V halve the blocks a budget holds
        dict(kv_cache_memory_bytes=70 * BLOCK_BYTES),
    ],
    ids=["chunked-prefill", "preemption"],
)
def test_draft_kv_follows_the_targets_blocks_under_pressure(tiny_dir, situation):
    prompts = prompts_of(8, seed=3)
    expected = run(make_llm(tiny_dir), prompts, GREEDY)
    llm = make_llm(tiny_dir, speculative_config=ITSELF, **situation)
    assert_same(run(llm, prompts, GREEDY), expected)
    if "kv_cache_memory_bytes" in situation:
        assert llm.llm_engine.scheduler.num_preemptions > 0
    assert acceptance(llm) > 0.9  # stale draft K/V after a preemption would guess wrong
    assert_no_leaks(llm)


def test_draft_model_with_n_samples_and_prefix_hits(tiny_dir):
    shared = prompts_of(1, seed=5)[0] * 2
    prompts = [shared + [7, 8], shared + [9], shared + [7, 8]]
    params = SamplingParams(n=3, temperature=0, max_tokens=30, ignore_eos=True)
    expected = run(make_llm(tiny_dir), prompts, params)
    llm = make_llm(tiny_dir, speculative_config=ITSELF)
    assert_same(run(llm, prompts, params), expected)
    assert_same(run(llm, prompts, params), expected)
    assert llm.llm_engine.prefix_cache_stats().hit_tokens > 0
    assert acceptance(llm) > 0.9
    assert_no_leaks(llm)


def test_aborted_requests_leave_nothing_behind(tiny_dir):
    prompts = prompts_of(6, seed=8)
    expected = run(make_llm(tiny_dir), prompts, GREEDY)
    llm = make_llm(tiny_dir, speculative_config=ITSELF)
    ids, finished = abort_every_other(llm, prompts, GREEDY)
    for index in range(1, 6, 2):
        assert finished[ids[index]] == expected[index].outputs[0].token_ids
    assert llm.llm_engine.proposer._progress == {}
    assert_no_leaks(llm)


def test_sleep_and_wake_keep_the_draft(tiny_dir):
    prompts = prompts_of(3, seed=4)
    llm = make_llm(tiny_dir, speculative_config=ITSELF)
    expected = run(llm, prompts, GREEDY)
    engine = llm.llm_engine
    engine.sleep(level=2)
    assert engine.draft_runner.kv_cache_bytes == 0
    engine.wake_up()
    assert_same(run(llm, prompts, GREEDY), expected)
    assert acceptance(llm) > 0.95


def test_the_draft_runs_the_native_step_on_quantized_weights(tiny_dir):
    prompts = prompts_of(3, seed=10)
    int4 = dict(quantization="int4", max_model_len=256)
    expected = run(make_llm(tiny_dir, **int4), prompts, GREEDY)
    llm = make_llm(tiny_dir, speculative_config=ITSELF, **int4)
    draft = llm.llm_engine.draft_runner
    if draft.native_step is None:
        pytest.skip("the native step did not build here")
    assert_same(run(llm, prompts, GREEDY), expected)
    assert draft.native_steps > 0
    # Not all: the target computes some positions on PyTorch's layers (steps that prefill)
    # where the draft ran the native step, and a random model's near-even logits flip on
    # that rounding.
    assert acceptance(llm) > 0.6


def test_adaptive_rule_counts_the_drafts_forward(tiny_dir):
    llm = make_llm(tiny_dir, speculative_config={**ITSELF, "adaptive_draft_length": True})
    assert llm.llm_engine.speculator.draft_cost == pytest.approx(1.0)
    run(llm, prompts_of(2, seed=6), GREEDY)
    assert llm.llm_engine.spec_stats.num_drafts == 0  # a draft as costly as a step never pays
    half = make_llm(tiny_dir, speculative_config={**ITSELF, "draft_layers": 1,
                                                   "adaptive_draft_length": True})  # fmt: skip
    assert 0.3 < half.llm_engine.speculator.draft_cost < 0.9


def test_drafts_the_target_cannot_check_are_refused(tiny_dir, tmp_path):
    wide = tmp_path / "wide"
    make_tiny_model("llama", wide)
    config = json.loads((wide / "config.json").read_text())
    (wide / "config.json").write_text(json.dumps({**config, "vocab_size": 512}))
    with pytest.raises(ValueError, match="vocabulary"):
        make_llm(tiny_dir, speculative_config={"model": str(wide), "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="draft_layers must be at most"):
        make_llm(tiny_dir, speculative_config={**ITSELF, "draft_layers": 3})
    gemma = tmp_path / "gemma"
    make_tiny_model("gemma3", gemma)
    with pytest.raises(ValueError, match="windows of their own"):
        make_llm(tiny_dir, speculative_config={"model": str(gemma), "num_speculative_tokens": 2})


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "mistral"])
def test_draft_models_of_the_llama_family(tmp_path, arch):
    make_tiny_model(arch, tmp_path / "target")
    make_tiny_model(arch, tmp_path / "draft", seed=1)
    prompts = prompts_of(4, seed=12)
    expected = run(make_llm(tmp_path / "target"), prompts, GREEDY)
    for spec in (ITSELF, {"model": str(tmp_path / "draft"), "num_speculative_tokens": 3,
                          "adaptive_draft_length": False}):  # fmt: skip
        llm = make_llm(tmp_path / "target", speculative_config=spec)
        assert_same(run(llm, prompts, GREEDY), expected)
        assert llm.llm_engine.spec_stats.num_drafts > 0
        assert_no_leaks(llm)
    assert acceptance(llm) < 0.9  # another model guesses worse than the target itself
