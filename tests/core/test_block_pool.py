import pytest

from forklift.core.block_pool import NULL_BLOCK_ID, BlockPool
from forklift.core.kv_cache_manager import KVCacheManager, blocks_for_tokens


def test_null_block_is_never_handed_out():
    pool = BlockPool(5)
    assert pool.num_free_blocks == 4
    ids = pool.allocate(4)
    assert NULL_BLOCK_ID not in ids
    assert sorted(ids) == [1, 2, 3, 4]
    with pytest.raises(MemoryError):
        pool.allocate(1)


def test_ref_counts_and_free_list_order():
    pool = BlockPool(6)
    a = pool.allocate(2)
    b = pool.allocate(2)
    pool.share(a[0])
    pool.free(a)
    # a[0] is still referenced once, so only a[1] returned to the free list.
    assert pool.num_free_blocks == 2
    assert pool.blocks[a[0]].ref_cnt == 1
    pool.free([a[0]])
    pool.free(b)
    assert pool.num_free_blocks == 5
    with pytest.raises(ValueError, match="freed twice"):
        pool.free([b[0]])
    with pytest.raises(ValueError, match="cannot be shared"):
        pool.share(b[0])


def test_freed_blocks_are_reused_last_in_lru_order():
    pool = BlockPool(4)
    first = pool.allocate(1)
    pool.free(first)
    # The free list hands out never-used blocks before the one just freed.
    assert pool.allocate(2) == [2, 3]
    assert pool.allocate(1) == first


def test_usage_fraction():
    pool = BlockPool(5)
    assert pool.usage() == 0.0
    pool.allocate(2)
    assert pool.usage() == pytest.approx(0.5)


def test_blocks_for_tokens():
    assert blocks_for_tokens(0, 16) == 0
    assert blocks_for_tokens(1, 16) == 1
    assert blocks_for_tokens(16, 16) == 1
    assert blocks_for_tokens(17, 16) == 2


def test_kv_manager_grows_tables_on_block_boundaries():
    kv = KVCacheManager(num_blocks=5, block_size=4)
    assert kv.allocate_slots("a", 3)
    assert len(kv.block_table("a")) == 1
    assert kv.allocate_slots("a", 4)
    assert len(kv.block_table("a")) == 1
    assert kv.allocate_slots("a", 5)
    assert len(kv.block_table("a")) == 2
    assert kv.allocate_slots("b", 8)
    assert kv.num_free_blocks == 0
    # Not enough room: nothing is allocated and the table is unchanged.
    assert not kv.allocate_slots("a", 9)
    assert len(kv.block_table("a")) == 2
    kv.free("a")
    kv.free("b")
    assert kv.num_free_blocks == 4
    assert kv.block_table("a") == []


def test_kv_manager_waste_is_under_one_block_per_request():
    block_size = 16
    kv = KVCacheManager(num_blocks=100, block_size=block_size)
    lengths = {"a": 3, "b": 17, "c": 32, "d": 50}
    for rid, n in lengths.items():
        assert kv.allocate_slots(rid, n)
    for rid, n in lengths.items():
        reserved = len(kv.block_table(rid)) * block_size
        assert 0 <= reserved - n < block_size


def test_never_used_blocks_come_first_in_id_order_then_the_freed_in_lru_order():
    pool = BlockPool(6)
    first = pool.allocate(2)
    assert first == [1, 2]
    pool.free(first)  # freed tail first: 2, then 1
    assert pool.num_free_blocks == 5
    assert pool.allocate(5) == [3, 4, 5, 2, 1]
    assert pool.num_free_blocks == 0
    assert len(pool.blocks) == 6 and [b.block_id for b in pool.blocks[-2:]] == [4, 5]
