"""Prefix caching in the KV-cache manager: chained keys, verification, LRU eviction, reset."""

from __future__ import annotations

import pytest

from forklift.core.block_pool import BlockKey
from forklift.core.kv_cache_manager import KVCacheManager, block_key

BLOCK = 4


def run_request(kv: KVCacheManager, rid: str, tokens: list[int], extra: bytes = b"") -> list[int]:
    """Admit `tokens` from the longest cached prefix, compute them all, register the blocks."""
    hits = kv.find_cached_prefix(tokens, extra)
    assert kv.allocate_slots(rid, len(tokens), hits)
    kv.cache_full_blocks(rid, tokens, len(tokens), extra)
    return hits


def test_a_shared_prefix_is_found_block_by_block():
    kv = KVCacheManager(num_blocks=32, block_size=BLOCK)
    first = list(range(100, 118))  # 4 full blocks + 2 tokens
    assert run_request(kv, "a", first) == []
    table_a = kv.block_table("a")
    second = first[:10] + [7, 7, 7, 7, 7, 7]  # shares 2 full blocks, diverges in the third
    assert kv.find_cached_prefix(second) == table_a[:2]
    assert run_request(kv, "b", second) == table_a[:2]
    # Shared blocks are referenced twice and the tail is b's own.
    assert kv.block_table("b")[:2] == table_a[:2]
    assert [kv.pool.blocks[b].ref_cnt for b in table_a[:2]] == [2, 2]
    assert set(kv.block_table("b")[2:]).isdisjoint(table_a)


def test_the_last_token_is_always_computed():
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK)
    tokens = list(range(8))  # exactly two full blocks
    run_request(kv, "a", tokens)
    # The second block holds the last token, so only the first is reused.
    assert len(kv.find_cached_prefix(tokens)) == 1
    assert len(kv.find_cached_prefix(tokens + [99])) == 2


def test_a_digest_match_with_other_tokens_is_not_a_hit():
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK)
    run_request(kv, "a", [1, 2, 3, 4, 5])
    real = block_key(b"", [1, 2, 3, 4], b"")
    forged = BlockKey(real.digest, real.parent_digest, (9, 9, 9, 9))
    assert kv.pool.lookup(real) == kv.block_table("a")[0]
    assert kv.pool.lookup(forged) is None


def test_extra_keys_separate_chains():
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK)
    tokens = list(range(9))
    run_request(kv, "a", tokens, b"salt-1")
    assert kv.find_cached_prefix(tokens, b"salt-2") == []
    assert len(kv.find_cached_prefix(tokens, b"salt-1")) == 2


def test_freed_blocks_stay_cached_until_evicted_lru_first():
    kv = KVCacheManager(num_blocks=9, block_size=BLOCK)  # 8 usable blocks
    old = list(range(200, 209))
    new = list(range(300, 309))
    run_request(kv, "old", old)
    kv.free("old")
    run_request(kv, "new", new)
    kv.free("new")
    assert kv.num_free_blocks == 8
    # Both freed requests are still cached; the free list evicts never-used blocks first.
    assert len(kv.find_cached_prefix(old)) == 2 and len(kv.find_cached_prefix(new)) == 2
    assert kv.allocate_slots("filler", 2 * BLOCK)
    assert len(kv.find_cached_prefix(old)) == 2
    # Now "old" (freed first) is reused tail first: its partial block, then its second full
    # block (an eviction); its head block and all of "new" stay cached.
    assert kv.allocate_slots("filler2", 2 * BLOCK)
    assert kv.pool.num_evictions == 1
    assert len(kv.find_cached_prefix(old)) == 1
    assert len(kv.find_cached_prefix(new)) == 2


def test_cache_hits_on_free_blocks_count_against_free_space():
    kv = KVCacheManager(num_blocks=5, block_size=BLOCK)  # 4 usable blocks
    tokens = list(range(13))  # 3 full blocks + 1 token
    run_request(kv, "a", tokens)
    kv.free("a")
    hits = kv.find_cached_prefix(tokens)
    assert len(hits) == 3 and kv.num_free_blocks == 4
    # Taking the 3 hits leaves one free block: room for the 4th block but not a 5th.
    assert not kv.allocate_slots("b", 5 * BLOCK, hits)
    assert kv.block_table("b") == [] and kv.num_free_blocks == 4
    assert kv.allocate_slots("b", 4 * BLOCK, hits)
    assert kv.block_table("b")[:3] == hits and kv.num_free_blocks == 0


def test_reset_forgets_everything_and_running_requests_never_register_old_blocks():
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK)
    tokens = list(range(12))
    run_request(kv, "done", tokens)
    kv.free("done")
    assert kv.allocate_slots("running", 6)
    kv.cache_full_blocks("running", list(range(50, 56)), 6)
    assert kv.reset_prefix_cache() == 3 + 1  # "done" and the running one
    assert kv.find_cached_prefix(tokens) == []
    # The running request computes more tokens after the reset: its blocks stay unregistered.
    assert kv.allocate_slots("running", 12)
    kv.cache_full_blocks("running", list(range(50, 62)), 12)
    assert kv.pool.num_cached_blocks == 0
    kv.free("running")
    # A request admitted after the reset caches normally.
    run_request(kv, "after", tokens)
    assert kv.pool.num_cached_blocks == 3


def test_disabled_prefix_caching_neither_finds_nor_registers():
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK, enable_prefix_caching=False)
    tokens = list(range(12))
    run_request(kv, "a", tokens)
    assert kv.pool.num_cached_blocks == 0
    assert kv.find_cached_prefix(tokens) == []


def test_share_prefix_refcounts_and_errors():
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK)
    assert kv.allocate_slots("leader", 10)
    kv.share_prefix("leader", "sample", 2)
    assert kv.block_table("sample") == kv.block_table("leader")[:2]
    with pytest.raises(ValueError, match="already has blocks"):
        kv.share_prefix("leader", "sample", 1)
    with pytest.raises(ValueError, match="fewer than"):
        kv.share_prefix("leader", "other", 4)
    kv.free("leader")
    # The sample still holds the shared blocks.
    assert kv.num_free_blocks == 15 - 2
    kv.free("sample")
    assert kv.num_free_blocks == 15


def test_copy_tail_block_gives_a_fresh_block_or_changes_nothing():
    kv = KVCacheManager(num_blocks=6, block_size=4)  # 5 usable blocks
    run_request(kv, "leader", list(range(1, 11)))  # 3 blocks
    kv.share_prefix("leader", "a", 2)
    copies = kv.copy_tail_block("leader", "a", 2)
    assert copies == [(kv.block_table("leader")[2], kv.block_table("a")[2])]
    assert kv.block_table("a")[:2] == kv.block_table("leader")[:2]
    kv.share_prefix("leader", "b", 2)
    assert kv.copy_tail_block("leader", "b", 2) is not None  # the last free block
    kv.share_prefix("leader", "c", 2)
    free = kv.num_free_blocks
    assert free == 0 and kv.copy_tail_block("leader", "c", 2) is None
    assert len(kv.block_table("c")) == 2
    assert kv.copy_tail_block("leader", "a", 2) is None  # "a" already holds block 2
