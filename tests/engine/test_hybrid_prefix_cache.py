"""Prefix caching for the hybrid family: K/V blocks as for any model, the linear layers' states
from checkpoints kept at block boundaries (core/state_checkpoints.py)."""

from __future__ import annotations

import pytest
from hybrid_cases import (
    GREEDY,
    assert_matches_hf,
    assert_nothing_held,
    chosen_logprobs,
    hybrid_engine,
    hybrid_prompts,
)
from tiny_models import make_tiny_hybrid

from forklift import LLM, SamplingParams
from forklift.core.state_checkpoints import CheckpointPlan, StateCheckpoints
from forklift.engine.snapshot import take_snapshot


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_hybrid("interval", tmp_path_factory.mktemp("hybrid-prefix"))


def _alone(llm: LLM, prompt: list[int]):
    (output,) = llm.generate([prompt], GREEDY, use_tqdm=False)
    return output


def _checkpoints(llm: LLM) -> StateCheckpoints:
    checkpoints = llm.llm_engine.kv_manager.state_checkpoints
    assert checkpoints is not None
    return checkpoints


def _with_checkpoints(llm: LLM, interval: int = 1024, capacity: int | None = None) -> LLM:
    """The engine's checkpoints replaced, before any request, by ones `interval` tokens apart
    (and only `capacity` slots) that these short prompts stop for (no minimum length)."""
    kv = llm.llm_engine.kv_manager
    slots = _checkpoints(llm).slots
    kv.state_checkpoints = StateCheckpoints(slots[:capacity], kv.block_size, interval, 0)
    return llm


def _cached_llm(path, **overrides) -> LLM:
    return _with_checkpoints(hybrid_engine(path, **overrides))


def test_a_repeated_prompt_resumes_from_its_checkpoint_with_the_same_output(model):
    prompt = hybrid_prompts(10, [41])[0]
    llm = _cached_llm(model.path)
    first, again = _alone(llm, prompt), _alone(llm, prompt)
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == 40  # the full blocks before the last prompt token
    # The miss stopped its prompt at the same boundary the hit resumes from: same bits.
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert chosen_logprobs(again) == chosen_logprobs(first)
    assert_matches_hf(model.hf_model, [prompt], [again])
    stats = llm.llm_engine.prefix_cache_stats()
    assert stats.enabled and stats.hit_tokens == 40
    kv = take_snapshot(llm.llm_engine).kv  # what /status shows
    assert kv["state_checkpoints"] == _checkpoints(llm).num_checkpoints == 2  # prompt, end
    assert kv["state_checkpoint_slots"] == _checkpoints(llm).capacity
    assert_nothing_held(llm)


def test_a_shared_system_prompt_leaves_a_checkpoint_where_the_requests_branch(model):
    system, a, b, c = hybrid_prompts(11, [36, 24, 14, 19])
    llm = _cached_llm(model.path)
    first = _alone(llm, system + a)
    # Its K/V cover the shared 36 tokens, but no checkpoint stands there yet: it computes
    # them and leaves one where the cached blocks ended.
    second = _alone(llm, system + b)
    third = _alone(llm, system + c)
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 0)
    assert third.num_cached_tokens == 36
    prompts = [system + a, system + b, system + c]
    assert_matches_hf(model.hf_model, prompts, [first, second, third])
    assert_nothing_held(llm)


def test_the_next_chat_turn_resumes_where_the_last_one_ended(model):
    prompt, extra, other = hybrid_prompts(12, [21, 7, 29])
    llm = hybrid_engine(model.path)
    turn = _alone(llm, prompt)
    _alone(llm, other)  # another conversation in between takes over the state slot
    follow_up = prompt + list(turn.outputs[0].token_ids) + extra
    next_turn = _alone(llm, follow_up)
    # 21 prompt + 16 output tokens, 36 of them computed: the last boundary it reached.
    assert next_turn.num_cached_tokens == 36
    assert_matches_hf(model.hf_model, [follow_up], [next_turn])
    assert_nothing_held(llm)


def test_a_long_prompt_keeps_checkpoints_every_interval_with_the_misses_bits(model):
    long, tail = hybrid_prompts(13, [70, 20])
    shared = long[:50] + tail
    llm = _with_checkpoints(hybrid_engine(model.path), interval=16)
    _alone(llm, long)
    hit = _alone(llm, shared)
    assert hit.num_cached_tokens == 48  # the last checkpoint (every 16) the 50 shared reach
    # A miss stops its prompt chunks at the same boundaries (16, 32, 48, ...): same bits.
    miss = _alone(_with_checkpoints(hybrid_engine(model.path), interval=16), shared)
    assert miss.num_cached_tokens == 0
    assert hit.outputs[0].token_ids == miss.outputs[0].token_ids
    assert chosen_logprobs(hit) == chosen_logprobs(miss)
    assert_matches_hf(model.hf_model, [shared], [hit])


def test_checkpoints_are_evicted_least_recently_used_and_reset_with_the_cache(model):
    prompts = hybrid_prompts(14, [30, 26, 34])
    llm = _with_checkpoints(hybrid_engine(model.path), capacity=2)
    outputs = [_alone(llm, p) for p in prompts]
    checkpoints = _checkpoints(llm)
    assert checkpoints.num_checkpoints == 2  # the last prompt's: its prompt's and its end's
    again_last, again_first = _alone(llm, prompts[2]), _alone(llm, prompts[0])
    assert again_last.num_cached_tokens == 32
    assert again_first.num_cached_tokens == 0  # evicted: computed again, with the same tokens
    assert again_first.outputs[0].token_ids == outputs[0].outputs[0].token_ids
    assert llm.llm_engine.reset_prefix_cache() > 0
    assert checkpoints.num_checkpoints == 0
    assert _alone(llm, prompts[2]).num_cached_tokens == 0
    assert_nothing_held(llm)


def test_the_memory_plan_counts_checkpoint_slots_in_the_state_tensors(model):
    llm = hybrid_engine(model.path)
    engine = llm.llm_engine
    plan = engine.kv_plan
    assert plan.num_checkpoint_slots == _checkpoints(llm).capacity > 0
    assert plan.checkpoint_bytes == plan.num_checkpoint_slots * plan.state_bytes_per_slot
    states = engine.runner.cache.recurrent_states
    assert states.shape[1] == 1 + plan.num_state_slots + plan.num_checkpoint_slots
    off = hybrid_engine(model.path, enable_prefix_caching=False).llm_engine
    assert off.kv_plan.num_checkpoint_slots == 0
    assert off.kv_manager.state_checkpoints is None
    assert off.runner.cache.recurrent_states.shape[1] == 1 + off.kv_plan.num_state_slots


def test_a_short_prompt_does_not_stop_for_a_checkpoint(model):
    prompt = hybrid_prompts(21, [41])[0]
    default = hybrid_engine(model.path, max_num_batched_tokens=64)
    eager = _cached_llm(model.path, max_num_batched_tokens=64)
    for llm in (default, eager):
        _alone(llm, prompt)
    first_steps = [s.num_batched_tokens for s in list(default.llm_engine.step_log)[:2]]
    assert first_steps == [41, 1]  # under MIN_CHECKPOINT_TOKENS: one step, no checkpoint
    assert [s.num_batched_tokens for s in list(eager.llm_engine.step_log)[:2]] == [40, 1]
    assert _alone(default, prompt).num_cached_tokens == 0
    assert _alone(eager, prompt).num_cached_tokens == 40


def test_a_prompt_tail_after_its_checkpoint_is_bounded_like_a_decode(model):
    """A prompt that stopped at its last checkpoint boundary samples its first token in the
    next step, so that step's prompt tokens (the tail's included) are at most
    decode_step_prefill_tokens, as beside decodes: the tail does not wait on a whole other
    prompt."""
    llm = _cached_llm(model.path, max_num_batched_tokens=64, decode_step_prefill_tokens=8)
    engine = llm.llm_engine
    first, second = hybrid_prompts(22, [43, 50])
    engine.add_request("first", {"prompt_token_ids": first}, GREEDY)
    engine.step()  # stops at 40, the end of the prompt's full blocks before its last token
    assert engine.step_log[-1].num_batched_tokens == 40
    engine.add_request("second", {"prompt_token_ids": second}, GREEDY)
    outputs = engine.step()
    assert engine.step_log[-1].num_batched_tokens == 8  # the tail's 3, 5 of the second's
    assert [o.request_id for o in outputs if o.outputs[0].token_ids] == ["first"]


def test_a_plan_stops_prompt_chunks_at_its_boundaries():
    plan = CheckpointPlan(block_size=4, interval=16, num_prompt_tokens=70, min_tokens=0)
    assert plan.prompt_end == 68
    assert [plan.next_boundary(s) for s in (0, 16, 20, 48, 64, 68)] == [16, 32, 32, 64, 68, None]
    branched = CheckpointPlan(
        block_size=4, interval=16, num_prompt_tokens=70, branch=36, min_tokens=0
    )
    assert branched.next_boundary(32) == 36
    assert [branched.is_boundary(p) for p in (32, 36, 40, 68, 72)] == [
        True, True, False, True, False,
    ]  # fmt: skip
    late = CheckpointPlan(block_size=4, interval=16, num_prompt_tokens=70, min_tokens=40)
    assert [late.next_boundary(s) for s in (0, 48, 64)] == [48, 64, 68]
    assert not late.is_boundary(32) and late.is_boundary(48)
    # Resumed at 60: stopping at 68 saves 8 tokens, enough only where the minimum is 8.
    for minimum, expected in ((8, 68), (12, None)):
        resumed = CheckpointPlan(4, 16, 70, min_tokens=minimum, resumed_at=60)
        assert resumed.next_boundary(60) == expected
        assert resumed.is_boundary(68) is (expected is not None)


def test_checkpoint_slots_are_indexed_held_or_free():
    checkpoints = StateCheckpoints([5, 6, 7, 8], block_size=4, interval=16)
    first = checkpoints.reserve(b"a")
    assert first is not None and checkpoints.reserve(b"a") is None  # one per chain
    for digest in (b"b", b"c", b"d"):
        checkpoints.reserve(digest)
    assert checkpoints.lookup(b"a") == first  # a hit: it now outlives those never hit
    assert checkpoints.reserve(b"e") is not None  # evicts b, the oldest never hit
    assert checkpoints.lookup(b"b") is None and checkpoints.lookup(b"a") == first
    held = checkpoints.hold("r", b"f")  # evicts c
    assert held is not None and checkpoints.lookup(b"c") is None
    assert checkpoints.hold("r", b"g") == held  # a later boundary: the same slot
    assert checkpoints.hold("s", b"h") is not None
    assert checkpoints.hold("t", b"i") is None  # at most half the slots are held
    checkpoints.release("r")  # filed under its last boundary
    assert checkpoints.lookup(b"g") == held and checkpoints.lookup(b"f") is None
    assert checkpoints.hold("s", b"a") is None  # that chain has one: nothing to copy
    checkpoints.release("s")  # its earlier boundary is not filed
    assert checkpoints.lookup(b"h") is None
    assert checkpoints.clear() == 3 and checkpoints.num_checkpoints == 0
    checkpoints.hold("u", b"j")
    checkpoints.clear()  # a reset while it runs: its slot is freed, not filed
    checkpoints.release("u")
    assert checkpoints.num_checkpoints == 0
    assert sorted(checkpoints.reserve(bytes([i])) for i in range(4)) == [5, 6, 7, 8]


def test_samples_of_a_repeated_prompt_fork_from_its_checkpoint(model):
    prompt = hybrid_prompts(15, [23])[0]
    llm = hybrid_engine(model.path)  # a short prompt: kept only because its samples fork there
    params = SamplingParams(n=4, temperature=0, max_tokens=16, ignore_eos=True)
    (first,) = llm.generate([prompt], params, use_tqdm=False)
    steps = len(llm.llm_engine.step_log)
    (again,) = llm.generate([prompt], params, use_tqdm=False)
    # The leader resumes at its fork (20 tokens) and its samples fork there at once,
    # instead of waiting for its last token and computing their prompts alone.
    assert again.num_cached_tokens == 20
    assert len(llm.llm_engine.step_log) - steps <= steps
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in first.outputs]
    assert_nothing_held(llm)


def test_a_shared_checkpoint_outlives_more_sequences_than_slots(model):
    system = hybrid_prompts(16, [36])[0]
    questions = hybrid_prompts(17, [5, 7, 3, 9, 4, 6, 8, 5, 6, 7])
    llm = _with_checkpoints(hybrid_engine(model.path, max_num_batched_tokens=512), capacity=4)
    for question in questions[:2]:  # the second leaves the checkpoint where they branch
        _alone(llm, system + question)
    for wave in (questions[2:6], questions[6:]):  # more at once than there are slots
        outputs = llm.generate([system + q for q in wave], GREEDY, use_tqdm=False)
        assert [o.num_cached_tokens for o in outputs] == [36] * len(wave)
    assert_matches_hf(model.hf_model, [system + q for q in questions[6:]], outputs)
    assert_nothing_held(llm)


def test_preempted_sequences_resume_from_checkpoints(model):
    system = hybrid_prompts(18, [24])[0]
    prompts = [system + q for q in hybrid_prompts(19, [6, 8, 4, 7, 5, 9])]
    # 39 blocks of 4 tokens: six sequences growing to about 48 tokens need 72.
    llm = _cached_llm(model.path, num_gpu_blocks_override=40, max_num_seqs=6, max_model_len=128)
    _alone(llm, prompts[0])
    _alone(llm, prompts[1])  # leaves a checkpoint where the system prompt ends
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    # The first two resume from their own prompts' ends, the rest where the system ends.
    assert [o.num_cached_tokens for o in outputs] == [28, 28, 24, 24, 24, 24]
    assert_matches_hf(model.hf_model, prompts, outputs)
    assert_nothing_held(llm)


def test_a_budget_without_room_for_a_checkpoint_turns_prefix_caching_off(model, caplog):
    # One sequence of 256 tokens needs 64 blocks: no checkpoint may take any of them.
    with caplog.at_level("INFO", logger="forklift"):
        llm = hybrid_engine(
            model.path, kv_cache_memory_bytes=84_000, max_model_len=256, max_num_seqs=1
        )
    assert llm.llm_engine.kv_plan.num_checkpoint_slots == 0
    assert "holds no linear-layer state checkpoint" in caplog.text
    assert llm.llm_engine.prefix_cache_stats().enabled is False
    prompt = hybrid_prompts(20, [30])[0]
    assert_matches_hf(model.hf_model, [prompt], [_alone(llm, prompt)])


SEEDED = SamplingParams(temperature=0.8, seed=11, max_tokens=16, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def sandwich(tmp_path_factory):
    return make_tiny_hybrid("sandwich", tmp_path_factory.mktemp("hybrid-prefix-sandwich"))


def _assert_close(output, reference) -> None:
    """The same tokens, and logprobs within what computing other chunks rounds."""
    assert output.outputs[0].token_ids == reference.outputs[0].token_ids
    assert chosen_logprobs(output) == pytest.approx(chosen_logprobs(reference), abs=1e-3)


@pytest.mark.parametrize("layout", ["interval", "sandwich"])
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_each_chat_turn_computes_only_its_new_tokens(model, sandwich, layout, params):
    path = (model if layout == "interval" else sandwich).path
    settings = dict(max_model_len=512, kv_cache_memory_bytes=2**22)
    cached, uncached = (
        hybrid_engine(path, **settings),
        hybrid_engine(path, enable_prefix_caching=False, **settings),
    )
    history: list[int] = []
    for turn, new in enumerate(hybrid_prompts(22, [8] * 8)):
        history += new
        (output,) = cached.generate([history], params, use_tqdm=False)
        (reference,) = uncached.generate([history], params, use_tqdm=False)
        _assert_close(output, reference)
        if turn:  # at most the new tokens and the last answer's partial block
            assert len(history) - output.num_cached_tokens <= len(new) + 4
        history += output.outputs[0].token_ids
    assert_nothing_held(cached)


def test_requests_behind_one_system_prompt_resume_where_it_ends(tmp_path):
    model = make_tiny_hybrid("interval", tmp_path, max_position_embeddings=1024)
    system = hybrid_prompts(23, [500])[0]
    # The first prompt's own end lies past the system prompt's: no checkpoint there yet.
    prompts = [system + q for q in hybrid_prompts(24, [11] + [3 + i % 9 for i in range(31)])]
    settings = dict(max_model_len=640, kv_cache_memory_bytes=2**23, max_num_batched_tokens=128)
    cached, uncached = (
        hybrid_engine(model.path, **settings),
        hybrid_engine(model.path, enable_prefix_caching=False, **settings),
    )
    outputs = [_alone(cached, p) for p in prompts[:2]]  # the second leaves the checkpoint
    outputs += cached.generate(prompts[2:], GREEDY, use_tqdm=False)
    assert [o.num_cached_tokens for o in outputs] == [0, 0] + [500] * 30
    for output, reference in zip(
        outputs, uncached.generate(prompts, GREEDY, use_tqdm=False), strict=True
    ):
        _assert_close(output, reference)
    assert_nothing_held(cached)


def test_lookup_drafts_on_sequences_resumed_from_checkpoints(model):
    prompts = [p * 2 for p in hybrid_prompts(25, [14, 20, 11])]
    expected = hybrid_engine(model.path, enable_prefix_caching=False).generate(
        prompts, GREEDY, use_tqdm=False
    )
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
    llm = _cached_llm(model.path, speculative_config=spec)
    llm.generate(prompts, GREEDY, use_tqdm=False)
    again = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert all(o.num_cached_tokens > 0 for o in again)
    assert llm.llm_engine.spec_stats.num_drafts > 0
    for output, reference in zip(again, expected, strict=True):
        _assert_close(output, reference)
    assert_nothing_held(llm)


def test_checkpoints_never_outlive_the_weights_or_a_sleep(model, tmp_path):
    other = make_tiny_hybrid("interval", tmp_path, seed=3)
    prompt = hybrid_prompts(26, [41])[0]
    llm = _cached_llm(model.path)
    assert _alone(llm, prompt).num_cached_tokens == 0
    assert _alone(llm, prompt).num_cached_tokens == 40
    llm.update_weights(list(other.hf_model.state_dict().items()))
    assert _checkpoints(llm).num_checkpoints == 0
    updated = _alone(llm, prompt)
    assert updated.num_cached_tokens == 0
    assert_matches_hf(other.hf_model, [prompt], [updated])
    assert _alone(llm, prompt).num_cached_tokens == 40  # the new weights' own checkpoint
    llm.sleep(level=1)
    llm.wake_up()
    woken = _alone(llm, prompt)
    assert woken.num_cached_tokens == 0
    assert_matches_hf(other.hf_model, [prompt], [woken])
    assert_nothing_held(llm)


def test_checkpoints_hit_again_outlive_those_hit_once():
    checkpoints = StateCheckpoints([1, 2, 3, 4], block_size=4, interval=16)
    for digest in (b"s", b"x", b"y", b"z"):
        checkpoints.reserve(digest)
    shared = checkpoints.lookup(b"s")
    assert checkpoints.lookup(b"s") == shared  # hit again: a system prompt's, say
    checkpoints.lookup(b"x")  # hit once (a chat turn's, read by the next turn)
    for digest in (b"p", b"q", b"r"):  # evict y, z, then x: least recently used first
        checkpoints.reserve(digest)
    assert [checkpoints.lookup(d) is None for d in (b"x", b"y", b"z")] == [True] * 3
    assert checkpoints.lookup(b"s") == shared
    for digest in (b"p", b"q", b"p", b"q"):  # two more hit again: past half the slots,
        checkpoints.lookup(digest)  # s, reused longest ago, goes back first in line
    checkpoints.reserve(b"t")
    assert checkpoints.lookup(b"s") is None
    assert checkpoints.lookup(b"p") is not None and checkpoints.lookup(b"q") is not None
