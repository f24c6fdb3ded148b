"""Property-based tests of the block pool and KV-cache manager under any sequence of
allocate, share, append, free, evict and reset."""

from __future__ import annotations

from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from forklift.core.block_pool import NULL_BLOCK_ID
from forklift.core.kv_cache_manager import KVCacheManager

BLOCK = 4
NUM_BLOCKS = 12
# A small alphabet over few lengths makes shared prefixes (and cache hits) common.
tokens_strategy = st.lists(st.integers(0, 2), min_size=1, max_size=24)


class KVCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, BLOCK)
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.next_id = 0

    def _new_id(self) -> str:
        self.next_id += 1
        return f"r{self.next_id}"

    @rule(tokens=tokens_strategy)
    def admit(self, tokens: list[int]) -> None:
        """Allocate a new request from its longest cached prefix (possibly evicting)."""
        rid = self._new_id()
        hits = self.kv.find_cached_prefix(tokens)
        free_before = self.kv.num_free_blocks
        if self.kv.allocate_slots(rid, len(tokens), hits):
            table = self.kv.block_table(rid)
            assert table[: len(hits)] == hits
            self.tokens[rid] = list(tokens)
            self.computed[rid] = len(tokens)
            self.kv.cache_full_blocks(rid, tokens, len(tokens))
        else:
            assert self.kv.block_table(rid) == []
            assert self.kv.num_free_blocks == free_before

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def share(self, data: st.DataObject) -> None:
        """A parallel sample takes the full blocks of a running request by reference."""
        source = data.draw(st.sampled_from(sorted(self.tokens)))
        num_full = self.computed[source] // BLOCK
        count = data.draw(st.integers(0, num_full))
        rid = self._new_id()
        self.kv.share_prefix(source, rid, count)
        self.tokens[rid] = self.tokens[source][: count * BLOCK]
        self.computed[rid] = count * BLOCK

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), extra=st.lists(st.integers(0, 2), min_size=1, max_size=6))
    def append(self, data: st.DataObject, extra: list[int]) -> None:
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        total = self.computed[rid] + len(extra)
        if self.kv.allocate_slots(rid, total):
            self.tokens[rid] += extra
            self.computed[rid] = total
            self.kv.cache_full_blocks(rid, self.tokens[rid], total)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.kv.free(rid)
        del self.tokens[rid], self.computed[rid]

    @rule()
    def reset(self) -> None:
        self.kv.reset_prefix_cache()
        assert self.kv.pool.num_cached_blocks == 0

    @invariant()
    def ref_counts_match_owners(self) -> None:
        owners = Counter(b for rid in self.tokens for b in self.kv.block_table(rid))
        pool = self.kv.pool
        assert NULL_BLOCK_ID not in owners
        for block in pool.blocks[1:]:
            assert block.ref_cnt == owners.get(block.block_id, 0)
        # A block is free exactly when nobody holds it; so no held block can be handed out.
        free = set(pool._free) | set(range(pool._next_fresh, NUM_BLOCKS))
        assert free == {b.block_id for b in pool.blocks[1:] if b.ref_cnt == 0}
        assert pool.num_free_blocks + len(owners) == NUM_BLOCKS - 1

    @invariant()
    def one_owner_per_unshared_block(self) -> None:
        # Two requests hold the same block only through sharing a prefix of equal tokens.
        holders: dict[int, list[str]] = {}
        for rid in self.tokens:
            for index, block_id in enumerate(self.kv.block_table(rid)):
                holders.setdefault(block_id, []).append((rid, index))
        for block_id, owners in holders.items():
            contents = {
                tuple(self.tokens[rid][i * BLOCK : (i + 1) * BLOCK])
                for rid, i in owners
                if (i + 1) * BLOCK <= self.computed[rid]
            }
            assert len(contents) <= 1, f"block {block_id} holds different tokens for {owners}"
            if len(owners) > 1:
                assert all((i + 1) * BLOCK <= self.computed[rid] for rid, i in owners)

    @invariant()
    def cached_blocks_hold_what_their_key_says(self) -> None:
        pool = self.kv.pool
        for block_id in pool._cached.values():
            assert pool.blocks[block_id].key is not None

    def teardown(self) -> None:
        for rid in list(self.tokens):
            self.kv.free(rid)
        # Every block comes back when all requests end.
        assert self.kv.num_free_blocks == NUM_BLOCKS - 1
        assert all(b.ref_cnt == 0 for b in self.kv.pool.blocks)


TestKVCacheMachine = KVCacheMachine.TestCase
TestKVCacheMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
