"""Speculation on hybrid models: rows verifying drafts chain the linear layers' state
through spare slots, and the sequence keeps the state after its last accepted token, so
outputs are those of decoding without speculation, token for token, and no slot leaks."""

from __future__ import annotations

import pytest
from spec_oracles import OracleProposer, sequences
from test_spec_decode_engine import (
    SPEC,
    abort_every_other,
    assert_same,
    prompts_of,
    run,
)
from tiny_models import make_tiny_hybrid

from forklift import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=30, ignore_eos=True, seed=4,
                        logprobs=2)  # fmt: skip


@pytest.fixture(scope="module", params=["interval", "odd-heads"])
def hybrid_dir(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(f"hybrid-{request.param}")
    make_tiny_hybrid(request.param, directory)
    return directory


def hybrid_llm(path, **overrides) -> LLM:
    kwargs = dict(model=str(path), dtype="float32", max_model_len=128, block_size=4,
                  kv_cache_memory_bytes=2**21, max_num_batched_tokens=32)  # fmt: skip
    return LLM(**{**kwargs, **overrides})


def with_oracle(llm: LLM, expected, **kwargs) -> OracleProposer:
    oracle = OracleProposer(sequences(expected), **kwargs)
    llm.llm_engine.proposer = oracle
    return oracle


def assert_nothing_held(llm: LLM) -> None:
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.num_free_blocks == engine.num_usable_blocks
    pool = engine.state_pool
    assert pool is not None and pool.num_lent == 0
    assert pool.num_free == pool.num_slots


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_hybrid_drafts_change_no_token(hybrid_dir, params):
    prompts = prompts_of(6, seed=1)
    expected = run(hybrid_llm(hybrid_dir), prompts, params)
    llm = hybrid_llm(hybrid_dir, speculative_config=SPEC)
    with_oracle(llm, expected)
    assert_same(run(llm, prompts, params), expected, logprobs=params.logprobs is not None)
    stats = llm.llm_engine.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # both kinds were seen
    assert_nothing_held(llm)


@pytest.mark.parametrize(
    "situation",
    [
        dict(num_gpu_blocks_override=40),  # preemption
        dict(max_num_seqs=2),  # queueing: few spare slots, new requests come first
        dict(max_num_batched_tokens=8, decode_step_prefill_tokens=4),  # chunked prefill
    ],
    ids=["preemption", "few-seqs", "chunked-prefill"],
)
def test_hybrid_drafts_under_scheduling_pressure(hybrid_dir, situation):
    prompts = prompts_of(8, seed=2)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    expected = run(hybrid_llm(hybrid_dir), prompts, params)
    llm = hybrid_llm(hybrid_dir, speculative_config=SPEC, **situation)
    with_oracle(llm, expected, seed=3)
    assert_same(run(llm, prompts, params), expected)
    if "num_gpu_blocks_override" in situation:
        assert llm.llm_engine.scheduler.num_preemptions > 0
    assert llm.llm_engine.spec_stats.num_accepted_tokens > 0
    assert_nothing_held(llm)


def test_hybrid_drafts_with_forked_samples_and_aborts(hybrid_dir):
    prompts = [p * 3 for p in prompts_of(2, seed=5)]
    params = SamplingParams(n=3, temperature=1.0, max_tokens=24, ignore_eos=True, seed=9)
    expected = run(hybrid_llm(hybrid_dir), prompts, params)
    llm = hybrid_llm(hybrid_dir, speculative_config=SPEC)
    with_oracle(llm, expected, seed=6)
    assert_same(run(llm, prompts, params), expected)
    abort_every_other(llm, prompts_of(4, 7), GREEDY, steps=5)
    assert_nothing_held(llm)


def test_lookup_proposers_run_on_hybrids(hybrid_dir):
    prompts = [p * 2 for p in prompts_of(4, seed=8)]
    expected = run(hybrid_llm(hybrid_dir), prompts, GREEDY)
    llm = hybrid_llm(hybrid_dir, speculative_config={**SPEC, "prompt_lookup_min": 1})
    assert_same(run(llm, prompts, GREEDY), expected)
    assert llm.llm_engine.spec_stats.num_drafts > 0
    assert_nothing_held(llm)


def test_a_hybrid_draft_model_is_refused(hybrid_dir):
    spec = {"method": "draft_model", "draft_layers": 1, "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="draft_model.*linear layers"):
        hybrid_llm(hybrid_dir, speculative_config=spec)
