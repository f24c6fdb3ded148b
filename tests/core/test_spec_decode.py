"""Speculative decoding's parts alone: the config, the proposers and the acceptance rule."""

from __future__ import annotations

import random

import pytest

from forklift.config import EngineConfig
from forklift.core.draft_budget import AcceptanceRecord, drafts_worth_verifying
from forklift.spec_decode.ngram import NgramProposer
from forklift.spec_decode.proposer import accepted_prefix
from forklift.spec_decode.stats import SpecDecodeStats
from forklift.spec_decode.suffix import SuffixProposer, SuffixTrie
from forklift.speculative_config import SpeculativeConfig


def test_config_takes_vllm_keys_from_a_dict_or_json():
    config = SpeculativeConfig.parse(
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'
    )
    assert config == SpeculativeConfig("ngram", 3, prompt_lookup_max=4, prompt_lookup_min=2)
    suffix = SpeculativeConfig.parse({"method": "suffix", "suffix_decoding_max_tree_depth": 16})
    assert suffix.num_speculative_tokens == 16  # as deep as the tries by default
    assert SpeculativeConfig.parse({"model": "[ngram]", "num_speculative_tokens": 2}).method == (
        "ngram"
    )
    draft = SpeculativeConfig.parse({"model": "some/draft", "num_speculative_tokens": 2})
    assert (draft.method, draft.model) == ("draft_model", "some/draft")  # vLLM's inference
    mtp = SpeculativeConfig.parse({"method": "qwen3_next_mtp", "num_speculative_tokens": 2})
    assert mtp.method == "mtp"  # vLLM's model-specific name
    engine = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert engine.speculation == SpeculativeConfig("ngram", 2)


@pytest.mark.parametrize(
    ("value", "named"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 2.5}, "num_speculative_tokens"),
        ({"method": "medusa", "num_speculative_tokens": 2}, "not supported yet"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "needs model"),
        (
            {"method": "draft_model", "num_speculative_tokens": 2, "draft_layers": 0},
            "draft_layers",
        ),  # fmt: skip
        ({"method": "ngram", "num_speculative_tokens": 2, "draft_layers": 2}, "draft_layers"),
        ({"method": "lookahead", "num_speculative_tokens": 2}, "method must be one of"),
        ({"method": "ngram", "num_speculative_tokens": 2, "typo_key": 1}, "typo_key"),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 4,
                "prompt_lookup_max": 3,
            },
            "prompt_lookup_max",
        ),  # fmt: skip
        (
            {"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 1},
            "disable_by_batch_size",
        ),  # fmt: skip
        ({"method": "suffix", "suffix_decoding_min_token_prob": 2}, "min_token_prob"),
        ({"method": "suffix", "suffix_decoding_max_spec_factor": 0}, "max_spec_factor"),
    ],
)
def test_bad_configs_name_the_key(value, named):
    with pytest.raises(ValueError, match=named):
        EngineConfig(speculative_config=value)


def test_ngram_proposes_what_followed_the_longest_latest_match():
    proposer = NgramProposer(min_n=2, max_n=3)
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    # [5, 2, 3] never came before; [2, 3] did, latest at position 5..6, followed by 7, 8.
    assert proposer.propose("a", tokens, 3) == [7, 8, 5]
    assert proposer.propose("a", tokens, 1) == [7]
    # A longer match wins over a later shorter one: [9, 1, 2] (then 4), not [1, 2] (then 6).
    assert proposer.propose("b", [9, 1, 2, 4, 1, 2, 6, 9, 1, 2], 2) == [4, 1]


def test_ngram_never_matches_the_tail_itself_and_grows_incrementally():
    proposer = NgramProposer(min_n=2, max_n=2)
    tokens = [4, 5]
    assert proposer.propose("a", tokens, 4) == []
    tokens += [6, 4, 5]
    assert proposer.propose("a", tokens, 4) == [6, 4, 5]
    tokens += [1]
    assert proposer.propose("a", tokens, 4) == []  # [5, 1] is new
    assert proposer.propose("a", tokens, 0) == []
    proposer.finish("a", tokens)
    assert proposer.num_tracked == 0


def test_suffix_proposes_from_its_own_tokens_and_from_finished_requests():
    proposer = SuffixProposer(depth=8, max_cached_requests=2, max_spec_factor=2.0,
                              min_token_prob=0.1)  # fmt: skip
    template = [10, 11, 12, 13, 14, 15]
    # The request's own prompt repeats: the tail [10, 11] continues as before.
    assert proposer.propose("a", [*template, 99, 10, 11], 3) == [12, 13, 14]
    # A finished request's output is proposed to a new request that starts like it.
    proposer.finish("b", [20, 21, 22, 23, 24])
    assert proposer.propose("c", [7, 20, 21], 4) == [22, 23, 24]
    # The match's length bounds the drafts (max_spec_factor 2 x 1 matched token).
    assert proposer.propose("d", [7, 23], 4) == [24]


def test_suffix_prefers_the_frequent_continuation_and_stops_when_unsure():
    proposer = SuffixProposer(depth=6, max_cached_requests=10, max_spec_factor=4.0,
                              min_token_prob=0.5)  # fmt: skip
    for index, ending in enumerate([[3, 4], [3, 4], [3, 5]]):
        proposer.finish(f"done{index}", [1, 2, *ending])
    # After [1, 2]: 3 always (3/3), then 4 two times in three (2/3 >= 0.5).
    assert proposer.propose("new", [1, 2], 4) == [3, 4]
    strict = SuffixProposer(6, 10, 4.0, min_token_prob=0.7)
    for index, ending in enumerate([[3, 4], [3, 4], [3, 5]]):
        strict.finish(f"done{index}", [1, 2, *ending])
    assert strict.propose("new", [1, 2], 4) == [3]


def test_suffix_cache_evicts_the_oldest_request_entirely():
    proposer = SuffixProposer(depth=4, max_cached_requests=1, max_spec_factor=4.0,
                              min_token_prob=0.1)  # fmt: skip
    proposer.finish("old", [1, 2, 3])
    proposer.finish("new", [5, 6, 7])
    assert proposer.num_cached_requests == 1
    assert proposer.propose("x", [1, 2], 2) == []  # forgotten
    assert proposer.propose("y", [5, 6], 2) == [7]
    children = proposer.global_trie.root.children or {}
    assert set(children) == {5, 6, 7}  # no node of the evicted request is left


def test_suffix_trie_counts_every_short_substring():
    trie = SuffixTrie(depth=3)
    trie.extend([], [1, 2, 1, 2])
    assert trie.match([1, 2]).count == 2
    assert trie.match([2, 1, 2]).count == 1
    assert trie.match([1, 2, 1, 2]) is None  # deeper than the trie
    trie.remove([1, 2, 1, 2])
    assert not trie.root.children


def test_acceptance_stops_at_the_first_disagreement():
    assert accepted_prefix([5, 6, 7], [5, 6, 7, 8]) == 3
    assert accepted_prefix([5, 6, 7], [5, 9, 7, 8]) == 1
    assert accepted_prefix([5, 6, 7], [4, 6, 7, 8]) == 0
    assert accepted_prefix([], [4]) == 0


def test_stats_count_acceptance_by_position():
    stats = SpecDecodeStats()
    stats.record(3, 2)
    stats.record(2, 0)
    assert stats.accepted_per_position == [1, 1, 0]
    assert stats.mean_acceptance_length == pytest.approx(1 + 2 / 2)
    assert stats.acceptance_rate == pytest.approx(2 / 5)


def test_drafts_pay_for_their_rows_only_when_likely_enough():
    # One sequence: rate**j >= 1/6 up to j = 4 at rate 2/3; eight: >= 8/13, so j = 1.
    assert drafts_worth_verifying(2 / 3, num_running=1, limit=8) == 4
    assert drafts_worth_verifying(2 / 3, num_running=8, limit=8) == 1
    assert drafts_worth_verifying(0.5, num_running=8, limit=8) == 0
    assert drafts_worth_verifying(0.99, num_running=1, limit=3) == 3
    assert drafts_worth_verifying(1.0, num_running=16, limit=5) == 5
    assert drafts_worth_verifying(0.9, num_running=1, limit=0) == 0
    # A draft model's forwards: at half a step each, one sequence needs rate**j >= 3.5/6.
    assert drafts_worth_verifying(0.9, num_running=1, limit=8, draft_cost=0.5) == 5
    assert drafts_worth_verifying(0.5, num_running=1, limit=8, draft_cost=0.5) == 0
    assert drafts_worth_verifying(1.0, num_running=1, limit=8, draft_cost=1.0) == 0


def test_acceptance_record_learns_and_forgets():
    record = AcceptanceRecord()
    prior = record.rate
    for _ in range(5):
        record.record(num_drafts=4, num_accepted=0)
    assert record.rate < 0.35 < prior  # the prior (2 in 3) still weighs in
    for _ in range(30):
        record.idle()
    assert record.rate == pytest.approx(prior, abs=0.01)
    for _ in range(10):
        record.record(num_drafts=4, num_accepted=4)
    assert record.rate > 0.9


def test_suffix_tails_kept_token_by_token_match_a_fresh_lookup():
    """The tails found in the shared trie, grown as tokens arrive, propose what looking every
    tail up again would (the shared trie changing as requests finish)."""
    rng = random.Random(0)
    kept = SuffixProposer(depth=8, max_cached_requests=3, max_spec_factor=2.0,
                          min_token_prob=0.1)  # fmt: skip
    fresh = SuffixProposer(depth=8, max_cached_requests=3, max_spec_factor=2.0,
                           min_token_prob=0.1)  # fmt: skip
    sequences = {f"r{i}": [rng.randrange(6) for _ in range(5)] for i in range(4)}
    proposed = 0
    for step in range(300):
        request_id = rng.choice(sorted(sequences))
        tokens = sequences[request_id]
        tokens += [rng.randrange(6) for _ in range(rng.choice([1, 1, 1, 3, 12]))]
        fresh._global_version += 1  # forces a fresh lookup of every tail
        got = kept.propose(request_id, tokens, 5)
        assert got == fresh.propose(request_id, tokens, 5)
        proposed += bool(got)
        if step % 25 == 24:
            for proposer in (kept, fresh):
                proposer.finish(request_id, tokens[5:])
            sequences[request_id] = [rng.randrange(6) for _ in range(5)]
    assert proposed > 100
