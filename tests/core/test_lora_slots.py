"""The scheduler's LoRA slot table: residency, users, LRU eviction of idle slots, reloads."""

from __future__ import annotations

from forklift.core.lora_slots import LoRASlotTable


def test_a_resident_adapter_is_shared_and_loaded_once():
    table = LoRASlotTable(2)
    assert table.acquire("r1", 7) == 0
    assert table.acquire("r2", 7) == 0
    assert table.take_loads() == [(0, 7)]
    assert table.slot_of("r1") == table.slot_of("r2") == 0
    assert table.slot_of("base") == -1


def test_busy_slots_make_a_new_adapter_wait_and_idle_ones_are_taken_lru_first():
    table = LoRASlotTable(2)
    table.acquire("r1", 1)
    table.acquire("r2", 2)
    assert not table.can_acquire("r3", 3)
    assert table.acquire("r3", 3) is None
    assert table.can_acquire("r4", 1)  # resident: shares the busy slot
    table.release("r2")
    table.release("r1")  # slot 1 (adapter 2) went idle first: it is evicted first
    table.take_loads()
    assert table.acquire("r3", 3) == 1
    assert table.take_loads() == [(1, 3)]
    assert table.residents() == [1, 3]
    assert table.acquire("r5", 1) == 0  # still resident: no load
    assert table.take_loads() == []


def test_reload_and_evict():
    table = LoRASlotTable(1)
    table.acquire("r1", 4)
    table.take_loads()
    table.reload(4)
    assert table.take_loads() == [(0, 4)]
    assert not table.evict(4)  # in use
    table.release("r1")
    assert table.evict(4)
    assert table.residents() == [None]
    assert table.acquire("r2", 5) == 0
    assert table.num_users() == 1
