"""KV groups: one pool, a table per group, windowed groups returning the blocks behind their
window (model/kv_layout.py, core/kv_cache_manager.py)."""

from __future__ import annotations

import pytest

from forklift.core.block_pool import NULL_BLOCK_ID
from forklift.core.kv_cache_manager import KVCacheManager
from forklift.model.kv_layout import KVGroup, kv_layout
from forklift.model.model_config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from forklift.runner.memory import plan_kv_cache

BLOCK = 4
WINDOW = 8  # two blocks


def gemma_like(layer_types: list[str], window: int = 512) -> ModelConfig:
    return ModelConfig(
        architecture="gemma3", vocab_size=262144, hidden_size=640, intermediate_size=2048,
        num_layers=len(layer_types), num_heads=4, num_kv_heads=1, head_dim=256,
        layer_types=tuple(layer_types), sliding_window=window, zero_centred_norms=True,
        sandwich_norms=True, mlp_activation="gelu_tanh",
    )  # fmt: skip


def gemma3_270m() -> ModelConfig:
    return gemma_like([SLIDING_ATTENTION if (i + 1) % 6 else FULL_ATTENTION for i in range(18)])


def test_layout_groups_full_layers_first_in_equal_groups():
    layout = kv_layout(gemma3_270m())
    assert layout.layers_per_block == 3
    assert layout.groups[0] == KVGroup((5, 11, 17), None)
    assert layout.groups[1:] == tuple(
        KVGroup(tuple(layers), 512)
        for layers in ((0, 1, 2), (3, 4, 6), (7, 8, 9), (10, 12, 13), (14, 15, 16))
    )
    assert layout.place(11) == (0, 1) and layout.place(6) == (2, 2)
    # Every attention layer has exactly one place.
    places = [layout.place(i) for i in range(18)]
    assert len(set(places)) == 18


def test_a_model_with_one_kind_of_layer_has_one_group():
    llama = ModelConfig("llama", 256, 64, 128, 4, 4, 2, 16)
    assert kv_layout(llama).groups == (KVGroup((0, 1, 2, 3), None),)
    only_sliding = gemma_like([SLIDING_ATTENTION] * 3, window=16)
    assert kv_layout(only_sliding).groups == (KVGroup((0, 1, 2), 16),)


def test_an_8k_gemma3_sequence_needs_under_a_quarter_of_full_kv():
    config = gemma3_270m()
    common = dict(model_config=config, block_size=16, kv_cache_memory_bytes=2**30,
                  memory_utilization=0.9, total_memory=2**34, weight_bytes=0,
                  activation_peak_bytes=0)  # fmt: skip
    plan = plan_kv_cache(dtype=__import__("torch").bfloat16, max_chunk=2048, **common)
    full_context = 8192 * 2 * 18 * 1 * 256 * 2  # K and V of every layer, bf16
    # What a decoding 8k sequence holds: its window in each sliding group.
    decoding = plan.blocks_per_sequence(8192, chunk=1) * plan.bytes_per_block
    assert decoding / full_context < 0.25, decoding / full_context
    # While a 2048-token chunk of it is computed, the sliding groups hold that chunk too.
    prefilling = plan.blocks_per_sequence(8192) * plan.bytes_per_block
    assert decoding < prefilling < full_context / 2


def allocate(kv: KVCacheManager, rid: str, computed: int, new: int, cached=()) -> None:
    assert kv.allocate_slots(rid, computed + new, cached, num_computed_tokens=computed)


def test_a_windowed_group_returns_blocks_behind_its_window():
    kv = KVCacheManager(num_blocks=64, block_size=BLOCK, windows=(None, WINDOW))
    allocate(kv, "a", 0, 20)  # a 20-token prefill: 5 blocks in each group
    full, window = kv.group_tables("a")
    assert len(full) == len(window) == 5 and NULL_BLOCK_ID not in window
    free = kv.num_free_blocks
    # Decoding position 20 reads positions 13..20 (a window of 8): blocks 3 and up.
    allocate(kv, "a", 20, 1)
    full, window = kv.group_tables("a")
    assert window[:3] == [NULL_BLOCK_ID] * 3 and NULL_BLOCK_ID not in window[3:]
    assert len(full) == 6 and NULL_BLOCK_ID not in full
    assert kv.num_free_blocks == free + 3 - 2  # three returned, one new block per group
    kv.free("a")
    assert kv.num_free_blocks == 63


def test_windowed_groups_bound_what_a_long_sequence_holds():
    kv = KVCacheManager(num_blocks=40, block_size=BLOCK, windows=(WINDOW, WINDOW))
    computed = 0
    for _ in range(200):  # 200 decodes need 50 blocks a group without the window
        allocate(kv, "a", computed, 1)
        computed += 1
        for table in kv.group_tables("a"):
            held = [b for b in table if b != NULL_BLOCK_ID]
            assert len(held) <= WINDOW // BLOCK + 1


def run(kv: KVCacheManager, rid: str, tokens: list[int]) -> list[list[int]]:
    hits = kv.lookup_prefix(tokens)
    start = len(hits[0]) * BLOCK
    allocate(kv, rid, start, len(tokens) - start, hits)
    kv.cache_full_blocks(rid, tokens, len(tokens))
    return hits


def test_a_windowed_prefix_hit_needs_only_the_blocks_its_window_reaches():
    kv = KVCacheManager(num_blocks=64, block_size=BLOCK, windows=(None, WINDOW))
    prompt = list(range(100, 125))  # 6 full blocks and one token
    run(kv, "a", prompt)
    # Decoding on frees the windowed group's early blocks, which stay cached in the pool.
    allocate(kv, "a", len(prompt), 1)
    full_a = list(kv.group_tables("a")[0])
    kv.free("a")
    hits = run(kv, "b", prompt)
    assert hits[0] == full_a[:6]
    # A hit of 6 blocks resumes at position 24, whose window reaches back to position 17.
    assert hits[1][:4] == [NULL_BLOCK_ID] * 4 and NULL_BLOCK_ID not in hits[1][4:6]


def test_a_hit_shrinks_to_where_the_window_blocks_are_still_cached():
    kv = KVCacheManager(num_blocks=64, block_size=BLOCK, windows=(None, WINDOW))
    prompt = list(range(100, 125))
    run(kv, "a", prompt)
    window_blocks = kv.group_tables("a")[1]
    kv.free("a")
    # Evict the windowed group's last cached block (block 5): only its content's chain
    # breaks, so the longest prefix both groups serve is 5 blocks.
    kv.pool._forget(kv.pool.blocks[window_blocks[5]])
    hits = kv.lookup_prefix(prompt)
    assert len(hits[0]) == len(hits[1]) == 5


def test_share_prefix_refuses_when_the_window_blocks_are_gone():
    kv = KVCacheManager(num_blocks=64, block_size=BLOCK, windows=(None, WINDOW))
    allocate(kv, "leader", 0, 17)
    assert kv.can_share_prefix("leader", 4)
    kv.share_prefix("leader", "early", 4)
    allocate(kv, "leader", 17, 1)
    allocate(kv, "leader", 18, 8)  # its window moves past blocks 0..3
    assert not kv.can_share_prefix("leader", 2)
    with pytest.raises(ValueError, match="no longer holds"):
        kv.share_prefix("leader", "late", 2)
    assert kv.group_tables("late") == [[], []]


@pytest.mark.parametrize("windows", [(None,), (None, WINDOW)])
def test_release_tail_and_free_return_every_block(windows):
    kv = KVCacheManager(num_blocks=64, block_size=BLOCK, windows=windows)
    allocate(kv, "a", 0, 30)
    kv.release_tail("a", 9)
    assert all(len(table) == 3 for table in kv.group_tables("a"))
    kv.free("a")
    assert kv.num_free_blocks == 63
