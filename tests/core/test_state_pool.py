"""The hybrid models' state slots: accounting like the block pool's, through the scheduler."""

from __future__ import annotations

import random

import pytest

from forklift.core.kv_cache_manager import KVCacheManager
from forklift.core.request import FinishReason, Request
from forklift.core.scheduler import Scheduler
from forklift.core.state_pool import StatePool
from forklift.sampling_params import SamplingParams


def test_slots_are_handed_out_once_and_come_back():
    pool = StatePool(3)
    slots = [pool.allocate(r) for r in ("a", "b", "c")]
    assert sorted(slots) == [1, 2, 3]  # slot 0 is the zero state, never handed out
    assert pool.allocate("d") is None
    assert pool.allocate("a") == slots[0]  # asking again keeps the same slot
    pool.free("b")
    pool.free("b")  # twice, or for an unknown request: ignored
    pool.free("zzz")
    assert pool.num_free == 1
    assert pool.allocate("d") == slots[1]


def test_lent_slots_are_kept_or_returned_after_verification():
    pool = StatePool(6)
    own = pool.allocate("a")
    lent = pool.lend(3)
    assert len(lent) == 3 and own not in lent and pool.num_free == 2
    pool.settle("a", lent, 2)  # two drafts accepted: the state after the second is kept
    assert pool.slot_of("a") == lent[1]
    assert pool.num_lent == 0 and pool.num_free == 5
    again = pool.lend(9)  # no more than are free
    assert len(again) == 5 and pool.num_free == 0
    pool.settle("a", again, 0)  # none accepted: the own slot stays
    assert pool.slot_of("a") == lent[1] and pool.num_free == 5
    gone = pool.lend(2)
    pool.free("a")
    pool.settle(None, gone, 1)  # aborted meanwhile: everything comes back
    assert pool.num_free == 6 and pool.num_lent == 0
    with pytest.raises(ValueError, match="not lent"):
        pool.settle("a", [1], 0)


def test_a_pool_needs_a_slot():
    with pytest.raises(ValueError, match="at least one slot"):
        StatePool(0)


def _request(rid: str, length: int, max_tokens: int) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, list(range(3, 3 + length)), params, seed=0, max_tokens=max_tokens)


def _check_invariants(scheduler: Scheduler, pool: StatePool) -> None:
    held = {r.request_id for r in scheduler.running}
    # Every running request holds a slot; waiting ones only when forked (none here).
    for request in scheduler.running:
        assert pool.slot_of(request.request_id) is not None
    slots = [pool.slot_of(r) for r in held]
    assert len(set(slots)) == len(slots)
    assert pool.num_free + len(held) == pool.num_slots


@pytest.mark.parametrize("seed", range(5))
def test_random_admissions_preemptions_and_aborts_leak_nothing(seed):
    rng = random.Random(seed)
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=False)
    pool = StatePool(4)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=16, state_pool=pool)
    requests = [_request(f"r{i}", rng.randint(1, 20), rng.randint(4, 16)) for i in range(30)]
    pending = list(requests)
    preempted = 0
    for _ in range(400):
        if pending and rng.random() < 0.3:
            scheduler.add_request(pending.pop())
        out = scheduler.schedule()
        preempted += len(out.preempted)
        _check_invariants(scheduler, pool)
        if out.is_empty:
            if not pending and not scheduler.has_unfinished_requests():
                break
            continue
        slots = [item.state_slot for item in out.scheduled]
        assert 0 not in slots and len(set(slots)) == len(slots)
        sampled = [1 if item.samples else None for item in out.scheduled]
        scheduler.update(out, sampled)
        if scheduler.running and rng.random() < 0.1:
            scheduler.finish(rng.choice(scheduler.running), FinishReason.ABORT)
        if scheduler.waiting and rng.random() < 0.1:
            scheduler.finish(rng.choice(list(scheduler.waiting)), FinishReason.ABORT)
    assert not scheduler.has_unfinished_requests()
    assert preempted > 0  # 15 blocks for four sequences of up to 36 tokens
    assert pool.num_free == pool.num_slots
    assert kv.num_free_blocks == 15
