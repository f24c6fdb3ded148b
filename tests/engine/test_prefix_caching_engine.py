"""Prefix caching and parallel sampling in the engine: same outputs, fewer blocks, counters."""

from __future__ import annotations

import random

import pytest
from test_engine import BLOCK_BYTES, make_llm, token_ids
from tiny_models import VOCAB, make_tiny_model

from forklift import LLM, SamplingParams
from forklift.engine.engine import sample_seed

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama-prefix")
    make_tiny_model("llama", directory)
    return directory


def tokens(count: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(count)]


def test_shared_system_prompt_outputs_match_with_caching_off(tiny_dir):
    system = tokens(41, seed=1)
    prompts = [system + tokens(5 + i, seed=100 + i) for i in range(8)]
    cached = make_llm(tiny_dir)
    plain = make_llm(tiny_dir, enable_prefix_caching=False)
    expected = token_ids(plain.generate(prompts, GREEDY, use_tqdm=False))
    # The first request fills the cache; the rest arrive after it and reuse the system prompt.
    first = cached.generate(prompts[:1], GREEDY, use_tqdm=False)
    rest = cached.generate(prompts[1:], GREEDY, use_tqdm=False)
    assert token_ids(first + rest) == expected
    assert first[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens == 40 for o in rest)  # 10 full blocks of the system prompt
    stats = cached.llm_engine.prefix_cache_stats()
    assert stats.hit_tokens == 7 * 40
    assert stats.query_tokens == sum(len(p) for p in prompts)
    assert plain.llm_engine.prefix_cache_stats().hit_tokens == 0


def test_multi_turn_reuses_the_previous_turn_and_its_answer(tiny_dir):
    cached = make_llm(tiny_dir)
    plain = make_llm(tiny_dir, enable_prefix_caching=False)
    conversation = tokens(23, seed=2)
    for turn in range(3):
        expected = plain.generate(conversation, GREEDY, use_tqdm=False)[0]
        got = cached.generate(conversation, GREEDY, use_tqdm=False)[0]
        assert got.outputs[0].token_ids == expected.outputs[0].token_ids
        # Every full block of the previous turn was cached, its answer's blocks included
        # (all but the answer's last token were computed): (previous + 11) // 4 blocks.
        previous = len(conversation) - 18
        assert got.num_cached_tokens == (0 if turn == 0 else (previous + 11) // 4 * 4)
        conversation = conversation + got.outputs[0].token_ids + tokens(6, seed=10 + turn)


def test_reset_prefix_cache_and_cache_salt_stop_reuse(tiny_dir):
    llm = make_llm(tiny_dir)
    prompt = tokens(30, seed=3)
    llm.generate(prompt, GREEDY, use_tqdm=False)
    assert llm.generate(prompt, GREEDY, use_tqdm=False)[0].num_cached_tokens == 28
    assert llm.reset_prefix_cache() > 0
    again = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0
    salted = {"prompt_token_ids": prompt, "cache_salt": "tenant-a"}
    assert llm.generate(salted, GREEDY, use_tqdm=False)[0].num_cached_tokens == 0
    assert llm.generate(salted, GREEDY, use_tqdm=False)[0].num_cached_tokens == 28
    other = {"prompt_token_ids": prompt, "cache_salt": "tenant-b"}
    assert llm.generate(other, GREEDY, use_tqdm=False)[0].num_cached_tokens == 0
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate({"prompt_token_ids": prompt, "cache_salt": 5}, GREEDY, use_tqdm=False)


def peak_blocks(llm: LLM, prompts: list, params: list[SamplingParams]) -> tuple[int, list]:
    engine = llm.llm_engine
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"p{i}", prompt, p)
    peak, finals = 0, {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
        peak = max(peak, engine.num_usable_blocks - engine.num_free_blocks)
    return peak, [finals[f"p{i}"] for i in range(len(prompts))]


def test_n_samples_share_prompt_blocks_and_match_their_solo_runs(tiny_dir):
    prompt = tokens(14, seed=4)  # 3 full blocks + 2 tokens
    params = SamplingParams(n=8, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    group = make_llm(tiny_dir, enable_prefix_caching=False)
    group_peak, (output,) = peak_blocks(group, [prompt], [params])
    solo = make_llm(tiny_dir, enable_prefix_caching=False)
    solo_params = [params.clone(n=1, seed=sample_seed(7, i)) for i in range(8)]
    solo_peak, solo_outputs = peak_blocks(solo, [prompt] * 8, solo_params)
    # Sample i of the group is exactly sample i run alone with its derived seed.
    assert [c.token_ids for c in output.outputs] == token_ids(solo_outputs)
    assert len({tuple(c.token_ids) for c in output.outputs}) > 1
    # Sampled after each step (finished requests have freed theirs): 8 independent requests
    # peak at 5 blocks each. The group stores its 3 full prompt blocks once and each sample
    # owns at most 2 more.
    assert solo_peak == 8 * 5
    assert group_peak <= 3 + 8 * 2 < solo_peak
    assert group.llm_engine.num_free_blocks == group.llm_engine.num_usable_blocks
    # Reproducible with the seed.
    again = make_llm(tiny_dir).generate(prompt, params, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in output.outputs]


def test_n_samples_decode_together_from_the_step_after_the_prompt(tiny_dir):
    prompt = tokens(14, seed=4)  # the samples copy the last block's 2 prompt tokens
    params = SamplingParams(n=8, temperature=1.0, seed=7, max_tokens=3, ignore_eos=True)
    llm = make_llm(tiny_dir)
    (output,) = llm.generate(prompt, params, use_tqdm=False)
    steps = [(s.num_batched_tokens, s.num_sampled) for s in llm.llm_engine.step_log]
    # The prompt once; then the leader's decode beside each sample's last prompt token.
    assert steps == [(14, 1), (8, 8), (8, 8), (7, 7)]
    assert all(len(c.token_ids) == 3 for c in output.outputs)
    assert llm.llm_engine.num_free_blocks == llm.llm_engine.num_usable_blocks


def test_a_copied_block_is_never_zeroed_over(tiny_dir):
    llm = make_llm(tiny_dir)
    engine = llm.llm_engine
    runner = engine.runner
    engine.add_request("r", tokens(6, seed=8), SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()  # the prompt: blocks 1 and 2 now written
    scheduled = engine.scheduler.schedule().scheduled
    table = list(scheduled[0].block_table)
    fresh = next(b for b in range(1, 64) if b not in table)
    scheduled[0].block_table = [*table, fresh]  # as a sample that took a copy reads it
    inputs = runner.input_builder.prepare(scheduled, block_copies=[(table[0], fresh)])
    assert fresh not in inputs.fresh_blocks.tolist()
    assert inputs.block_copies.tolist() == [[table[0], fresh]]
    again = runner.input_builder.prepare(scheduled)
    assert fresh not in again.fresh_blocks.tolist()


def test_blocks_are_zeroed_before_their_first_read(tiny_dir):
    """A never-written block may hold anything (torch.empty): NaNs there must not reach a
    sequence, whose attention reads its last block whole."""
    prompts = [tokens(6 + i, seed=30 + i) for i in range(3)]
    outputs = []
    for garbage in (0.0, float("nan")):
        llm = make_llm(tiny_dir)
        llm.llm_engine.runner.cache.blocks[:, :, :, 1:] = garbage  # null block 0 stays
        outputs.append(token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)))
    assert outputs[1] == outputs[0]


def test_samples_waiting_for_a_seat_match_their_solo_runs(tiny_dir):
    # Four seats for eight samples: three copy the last prompt block and start at once, the
    # others wait and compute it themselves.
    prompt = tokens(14, seed=6)
    params = SamplingParams(n=8, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True)
    got = make_llm(tiny_dir, max_num_seqs=4).generate(prompt, params, use_tqdm=False)[0]
    solo_params = [params.clone(n=1, seed=sample_seed(5, i)) for i in range(8)]
    solo = make_llm(tiny_dir).generate([prompt] * 8, solo_params, use_tqdm=False)
    assert [c.token_ids for c in got.outputs] == token_ids(solo)


def test_n_samples_survive_preemption_and_abort(tiny_dir):
    prompt = tokens(30, seed=5)
    params = SamplingParams(n=6, temperature=0.8, seed=3, max_tokens=30, ignore_eos=True)
    expected = make_llm(tiny_dir).generate(prompt, params, use_tqdm=False)[0]
    small = make_llm(tiny_dir, kv_cache_memory_bytes=34 * BLOCK_BYTES, max_model_len=64)
    got = small.generate(prompt, params, use_tqdm=False)[0]
    assert small.llm_engine.scheduler.num_preemptions > 0
    assert [c.token_ids for c in got.outputs] == [c.token_ids for c in expected.outputs]
    engine = small.llm_engine
    engine.add_request("group", prompt, params)
    engine.step()  # the leader's prompt; the others wait
    engine.abort_request("group")
    assert not engine.has_unfinished_requests()
    assert engine.num_free_blocks == engine.num_usable_blocks
    assert not engine.scheduler.has_unfinished_requests()


def test_default_model_chat_with_shared_system_prompt(default_llm_fp32, default_source):
    system = {"role": "system", "content": "You are a terse assistant. " * 12}
    questions = ["Name a primary colour.", "What is 2 + 2?", "Say hi."]
    conversations = [[system, {"role": "user", "content": q}] for q in questions]
    params = SamplingParams(temperature=0, max_tokens=10)
    llm = default_llm_fp32
    hits_before = llm.llm_engine.prefix_cache_stats().hit_tokens
    got = [llm.chat(c, params, use_tqdm=False)[0] for c in conversations]
    assert llm.llm_engine.prefix_cache_stats().hit_tokens > hits_before
    assert all(o.num_cached_tokens >= 64 for o in got[1:])
    plain = LLM(
        model=str(default_source.path),
        dtype="float32",
        max_model_len=512,
        kv_cache_memory_bytes=64 * 2**20,
        enable_prefix_caching=False,
    )
    expected = plain.chat(conversations, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
