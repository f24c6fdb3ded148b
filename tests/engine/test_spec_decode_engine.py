"""Speculative decoding in the engine: outputs are those of decoding without it, token for
token, greedy and seeded, under every scheduling situation; no block leaks.

Most tests drive the engine with an oracle proposer that knows the outputs of a run without
speculation and proposes them with some tokens corrupted, so every step mixes accepted and
rejected drafts; the real proposers run on a tiny model too."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
from spec_oracles import sequences, with_oracle
from test_engine import BLOCK_BYTES, make_llm
from tiny_models import VOCAB, make_tiny_model

from forklift import LLM, SamplingParams, StructuredOutputsParams
from forklift.core.kv_cache_manager import blocks_for_tokens


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama-spec")
    make_tiny_model("llama", directory)
    return directory


def prompts_of(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 30))] for _ in range(count)]


def run(llm: LLM, prompts, params):
    return llm.generate(prompts, params, use_tqdm=False)


def assert_same(got, expected, logprobs: bool = False) -> None:
    for a, b in zip(got, expected, strict=True):
        for x, y in zip(a.outputs, b.outputs, strict=True):
            assert x.token_ids == y.token_ids
            assert x.text == y.text
            assert x.finish_reason == y.finish_reason
            if logprobs:
                for p, q in zip(x.logprobs, y.logprobs, strict=True):
                    assert p.keys() == q.keys()
                    for t in p:
                        assert p[t].logprob == pytest.approx(q[t].logprob, abs=1e-4)


def abort_every_other(
    llm: LLM, prompts, params, steps: int = 4
) -> tuple[list[str], dict[str, list[int]]]:
    """Start every prompt, take `steps` steps, abort every other request and run the rest
    to their end: the request ids, and the tokens of those that finished."""
    engine = llm.llm_engine
    ids = [engine.add_request(None, {"prompt_token_ids": p}, params) for p in prompts]
    for _ in range(steps):
        engine.step()
    engine.abort_request(ids[::2])
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0].token_ids
    return ids, finished


def assert_no_leaks(llm: LLM) -> None:
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.kv_manager.block_tables() == {}
    assert engine.num_free_blocks == engine.num_usable_blocks


# Fixed draft lengths: the oracle's drafts would otherwise be cut by the adaptive rule.
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "adaptive_draft_length": False}

SAMPLING = [
    SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
    SamplingParams(
        temperature=0.9, top_p=0.9, top_k=40, max_tokens=40, ignore_eos=True, seed=11, logprobs=3
    ),  # fmt: skip
    SamplingParams(
        temperature=1.0,
        min_p=0.05,
        presence_penalty=0.5,
        repetition_penalty=1.2,
        frequency_penalty=0.3,
        max_tokens=40,
        ignore_eos=True,
        seed=5,
    ),  # fmt: skip
]


@pytest.mark.parametrize("params", SAMPLING, ids=["greedy", "top-p-logprobs", "penalties"])
def test_oracle_drafts_change_no_token(tiny_dir, params):
    prompts = prompts_of(8, seed=1)
    expected = run(make_llm(tiny_dir), prompts, params)
    llm = make_llm(tiny_dir, speculative_config=SPEC)
    with_oracle(llm, sequences(expected))
    got = run(llm, prompts, params)
    assert_same(got, expected, logprobs=params.logprobs is not None)
    stats = llm.llm_engine.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # both kinds were seen
    assert_no_leaks(llm)


@pytest.mark.parametrize(
    "situation",
    [
        dict(max_num_batched_tokens=16, decode_step_prefill_tokens=8),  # chunked prefill
        dict(kv_cache_memory_bytes=34 * BLOCK_BYTES),  # preemption
        dict(max_num_seqs=3),  # queueing
    ],
    ids=["chunked-prefill", "preemption", "few-seqs"],
)
def test_oracle_drafts_under_scheduling_pressure(tiny_dir, situation):
    prompts = prompts_of(8, seed=2)
    params = SamplingParams(temperature=0.8, max_tokens=40, ignore_eos=True, seed=3)
    expected = run(make_llm(tiny_dir), prompts, params)
    llm = make_llm(tiny_dir, speculative_config=SPEC, **situation)
    with_oracle(llm, sequences(expected), seed=4)
    assert_same(run(llm, prompts, params), expected)
    if "kv_cache_memory_bytes" in situation:
        assert llm.llm_engine.scheduler.num_preemptions > 0
    assert llm.llm_engine.spec_stats.num_accepted_tokens > 0
    assert_no_leaks(llm)


def test_oracle_drafts_with_n_samples_and_prefix_caching(tiny_dir):
    shared = prompts_of(1, seed=5)[0] * 2
    prompts = [shared + [7, 8], shared + [9], shared + [7, 8]]
    params = SamplingParams(n=3, temperature=1.0, max_tokens=30, ignore_eos=True, seed=9)
    expected = run(make_llm(tiny_dir), prompts, params)
    llm = make_llm(tiny_dir, speculative_config=SPEC)
    with_oracle(llm, sequences(expected), seed=6)
    got = run(llm, prompts, params)
    assert_same(got, expected)
    # A later run reuses blocks the speculating run cached: they hold the right K/V.
    assert_same(run(llm, prompts, params), expected)
    assert llm.llm_engine.prefix_cache_stats().hit_tokens > 0
    assert_no_leaks(llm)


def test_rejected_drafts_give_their_blocks_back_each_step(tiny_dir):
    prompts = prompts_of(4, seed=7)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = run(make_llm(tiny_dir), prompts, params)
    llm = make_llm(tiny_dir, speculative_config={**SPEC, "num_speculative_tokens": 8})
    with_oracle(llm, sequences(expected), corrupt=0.8)
    engine = llm.llm_engine
    for prompt in prompts:
        engine.add_request(None, {"prompt_token_ids": prompt}, params)
    while engine.has_unfinished_requests():
        engine.step()
        for request in engine.scheduler.running:
            table = engine.kv_manager.block_table(request.request_id)
            # Nothing beyond the blocks its tokens need, though 8 drafts were reserved for.
            assert len(table) <= blocks_for_tokens(request.num_tokens, 4)
    assert engine.spec_stats.num_accepted_tokens < engine.spec_stats.num_draft_tokens
    assert_no_leaks(llm)


def test_aborts_between_steps_leave_nothing_behind(tiny_dir):
    prompts = prompts_of(6, seed=8)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = run(make_llm(tiny_dir), prompts, params)
    llm = make_llm(tiny_dir, speculative_config=SPEC)
    oracle = with_oracle(llm, sequences(expected))
    ids, finished = abort_every_other(llm, prompts, params)
    for index in range(1, 6, 2):
        assert finished[ids[index]] == expected[index].outputs[0].token_ids
    assert sorted(oracle.finished) == sorted(ids)  # the proposer forgot every request
    assert_no_leaks(llm)


def test_stops_hold_exactly_at_the_accepted_boundary(tiny_dir):
    prompt = prompts_of(1, seed=9)[0]
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = make_llm(tiny_dir)
    reference = run(plain, [prompt], greedy)[0].outputs[0]
    stop_token, text = reference.token_ids[9], reference.text.split()
    cases = [
        greedy.clone(max_tokens=13),
        SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop_token]),
        SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop_token], min_tokens=12),
        greedy.clone(stop=[" ".join(text[6:8])]),
        greedy.clone(stop=[" ".join(text[6:8])], min_tokens=9),
        greedy.clone(stop=[" ".join(text[6:8])], include_stop_str_in_output=True),
    ]
    llm = make_llm(tiny_dir, speculative_config={**SPEC, "num_speculative_tokens": 6})
    for params in cases:
        expected = run(plain, [prompt], params)
        with_oracle(llm, sequences(run(plain, [prompt], greedy)), corrupt=0.1)
        assert_same(run(llm, [prompt], params), expected)
    assert llm.llm_engine.spec_stats.num_accepted_tokens > 0
    assert_no_leaks(llm)


# A random model rarely repeats itself: single-token lookups make n-gram proposals frequent
# (and mostly wrong); the suffix proposer's second run finds the first run's outputs.
REAL_METHODS = [
    {**SPEC, "prompt_lookup_min": 1},
    {"method": "suffix", "suffix_decoding_max_spec_factor": 4.0},
]


@pytest.mark.parametrize("method", REAL_METHODS, ids=["ngram", "suffix"])
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])
def test_real_proposers_change_no_token(tmp_path, method, arch):
    make_tiny_model(arch, tmp_path)
    prompts = [p * 2 for p in prompts_of(6, seed=3)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = run(make_llm(tmp_path), prompts, params)
    llm = make_llm(tmp_path, speculative_config=method)
    assert_same(run(llm, prompts, params), expected)
    assert_same(run(llm, prompts, params), expected)
    stats = llm.llm_engine.spec_stats
    assert stats.num_drafts > 0
    if method["method"] == "suffix":
        assert stats.num_accepted_tokens >= 40  # the second run repeats the first's outputs
    assert_no_leaks(llm)


def test_native_step_verifies_drafts(tmp_path):
    make_tiny_model("llama", tmp_path)
    prompts = prompts_of(3, seed=10)
    params = SamplingParams(temperature=0.7, max_tokens=30, ignore_eos=True, seed=1)
    int4 = dict(quantization="int4", max_model_len=256)
    expected = run(make_llm(tmp_path, **int4), prompts, params)
    llm = make_llm(tmp_path, speculative_config=SPEC, **int4)
    if llm.llm_engine.runner.native_step is None:
        pytest.skip("the native step did not build here")
    with_oracle(llm, sequences(expected))
    before = llm.llm_engine.runner.native_steps
    assert_same(run(llm, prompts, params), expected)
    assert llm.llm_engine.runner.native_steps > before
    assert llm.llm_engine.spec_stats.num_accepted_tokens > 0


def test_default_model_greedy_is_unchanged_by_long_verifications(default_source):
    """The default model on its own kernels (the native step where it builds): right drafts
    of 4 to 12 tokens verify as 5 to 13 rows of one sequence, and the text is that of
    decoding alone, token for token (a row's logits must not depend on its neighbours)."""
    prompt = [{"role": "user", "content": "Tell me a story about the sea and a lighthouse."}]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    settings = dict(model=str(default_source.path), max_model_len=512,
                    kv_cache_memory_bytes=32 * 2**20, enable_prefix_caching=False)  # fmt: skip
    expected = LLM(**settings).chat([prompt], params, use_tqdm=False)
    for drafts in (4, 7, 12):
        spec = {**SPEC, "num_speculative_tokens": drafts}
        llm = LLM(**settings, speculative_config=spec)
        with_oracle(llm, sequences(expected), corrupt=0.0)
        assert_same(llm.chat([prompt], params, use_tqdm=False), expected)
        stats = llm.llm_engine.spec_stats
        assert stats.num_accepted_tokens >= 30 and max(stats.accepted_per_position) > 0


def test_default_model_greedy_holds_past_one_attention_chunk(default_source):
    """As above past 1024 positions of context, where the native step's attention splits
    the positions into chunks and merges their partial results: verifying 8 rows gives the
    text of decoding alone, token for token."""
    story = "The keeper counted the waves and wrote each one down in his book. " * 90
    prompt = [{"role": "user", "content": story + "What did the keeper do?"}]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    settings = dict(model=str(default_source.path), max_model_len=1600,
                    kv_cache_memory_bytes=128 * 2**20, enable_prefix_caching=False)  # fmt: skip
    alone = LLM(**settings)
    expected = alone.chat([prompt], params, use_tqdm=False)
    assert len(expected[0].prompt_token_ids) > 1100
    llm = LLM(**settings, speculative_config={**SPEC, "num_speculative_tokens": 7})
    with_oracle(llm, sequences(expected), corrupt=0.0)
    assert_same(llm.chat([prompt], params, use_tqdm=False), expected)
    assert llm.llm_engine.spec_stats.num_accepted_tokens >= 20
    if alone.llm_engine.runner.native_step is not None:
        assert alone.llm_engine.runner.native_steps > 0 and llm.llm_engine.runner.native_steps > 0


def test_sampled_distribution_is_the_targets(tiny_dir):
    """Many seeds: the token drawn right after drafts (accepted or not) has the distribution
    of decoding without speculation. Different seeds on each side, so equality of outputs
    per seed (tested above) does not make this pass by itself; chi-square at alpha 0.001."""
    prompt = prompts_of(1, seed=12)[0]
    samples = 300
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    reference = sequences(run(make_llm(tiny_dir), [prompt], greedy))
    plain_params = SamplingParams(n=samples, temperature=1.5, max_tokens=3, ignore_eos=True,
                                  seed=1)  # fmt: skip
    spec_params = plain_params.clone(seed=2)
    plain = run(make_llm(tiny_dir, max_n=samples), [prompt], plain_params)[0]
    llm = make_llm(tiny_dir, speculative_config=SPEC, max_num_seqs=samples, max_n=samples)
    with_oracle(llm, reference, corrupt=0.0)  # always the greedy path's tokens as drafts
    spec = run(llm, [prompt], spec_params)[0]
    assert llm.llm_engine.spec_stats.num_drafts > 0
    for position in range(3):
        a = Counter(c.token_ids[position] for c in plain.outputs)
        b = Counter(c.token_ids[position] for c in spec.outputs)
        tokens = [t for t in set(a) | set(b) if a[t] + b[t] >= 10]
        statistic = sum((a[t] - b[t]) ** 2 / (a[t] + b[t]) for t in tokens)
        dof = max(len(tokens) - 1, 1)
        # Wilson-Hilferty: the chi-square quantile at 1 - 0.001 for dof degrees of freedom.
        z = 3.09
        bound = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
        assert statistic < bound, (position, statistic, bound)


@pytest.mark.parametrize("corrupt", [0.0, 0.5])
def test_structured_outputs_speculate_within_the_grammar(default_source, corrupt):
    """Drafts under a grammar are cut to what it allows; each verification row's mask is
    the grammar's after the drafts before it; the text is that of decoding alone."""
    schema = {"type": "object", "properties": {"city": {"type": "string"},
              "country": {"type": "string"}, "population": {"type": "integer"}},
              "required": ["city", "country", "population"]}  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=48,
                            structured_outputs=StructuredOutputsParams(json=schema))  # fmt: skip
    prompt = [{"role": "user", "content": "Describe Paris as JSON with city, country and "
               "population, like {\"city\": \"Rome\", \"country\": \"Italy\", "
               "\"population\": 2800000}."}]  # fmt: skip
    settings = dict(model=str(default_source.path), max_model_len=512,
                    kv_cache_memory_bytes=32 * 2**20)  # fmt: skip
    expected = LLM(**settings).chat([prompt], params, use_tqdm=False)
    llm = LLM(**settings, speculative_config=SPEC)
    oracle = with_oracle(llm, sequences(expected), corrupt=corrupt)
    proposed: list[int] = []
    original = oracle.propose

    def propose(request_id, token_ids, max_tokens):
        drafts = original(request_id, token_ids, max_tokens)
        proposed.append(len(drafts))
        return drafts

    oracle.propose = propose
    assert_same(llm.chat([prompt], params, use_tqdm=False), expected)
    stats = llm.llm_engine.spec_stats
    assert stats.num_accepted_tokens > 0
    if corrupt:  # some corrupted drafts broke the grammar and were cut before verifying
        assert stats.num_draft_tokens < sum(proposed)


def test_disable_by_batch_size_turns_drafts_off_under_load(tiny_dir):
    prompts = prompts_of(4, seed=13)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    references = sequences(run(make_llm(tiny_dir), prompts, params))
    llm = make_llm(tiny_dir, speculative_config={**SPEC, "disable_by_batch_size": 2})
    with_oracle(llm, references)
    run(llm, prompts, params)
    assert llm.llm_engine.spec_stats.num_drafts == 0
    run(llm, prompts[:1], params)
    assert llm.llm_engine.spec_stats.num_drafts > 0


def test_adaptive_draft_length_follows_acceptance_and_load(tiny_dir):
    prompts = prompts_of(8, seed=14)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = run(make_llm(tiny_dir), prompts, params)
    adaptive = {**SPEC, "num_speculative_tokens": 8, "adaptive_draft_length": True}

    def drafts_per_verification(count: int, corrupt: float) -> float:
        llm = make_llm(tiny_dir, speculative_config=adaptive)
        with_oracle(llm, sequences(expected), corrupt=corrupt)
        assert_same(run(llm, prompts[:count], params), expected[:count])
        stats = llm.llm_engine.spec_stats
        return stats.num_draft_tokens / max(stats.num_drafts, 1)

    # Alone, a sequence whose drafts hold speculates longer than one whose drafts fail,
    # and eight running at once speculate less than one alone.
    assert drafts_per_verification(1, corrupt=0.0) > drafts_per_verification(1, corrupt=1.0)
    assert drafts_per_verification(8, corrupt=0.0) < drafts_per_verification(1, corrupt=0.0)
