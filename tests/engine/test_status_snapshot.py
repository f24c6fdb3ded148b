"""The status snapshot agrees with the block pool and the scheduler; the history buckets."""

from __future__ import annotations

import pytest
from tiny_models import make_tiny_model

from forklift import LLMEngine, SamplingParams
from forklift.core.block_pool import NULL_BLOCK_ID
from forklift.engine.snapshot import (
    CACHED,
    FREE,
    HELD,
    HELD_CACHED,
    MAX_WAITING_SHOWN,
    NULL,
    take_snapshot,
)
from forklift.server.status.history import StatusHistory

# 2 layers x 2 KV heads x head_dim 16 x fp32, K and V, 4-token blocks.
BLOCK_BYTES = 2 * 2 * 2 * 16 * 4 * 4


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama-status")
    make_tiny_model("llama", directory)
    return directory


def make_engine(path, blocks: int = 60) -> LLMEngine:
    return LLMEngine.from_kwargs(
        model=str(path),
        dtype="float32",
        max_model_len=96,
        block_size=4,
        kv_cache_memory_bytes=blocks * BLOCK_BYTES,
        max_num_batched_tokens=32,
        enforce_eager=True,
    )


def expected_state(block) -> int:
    if block.block_id == NULL_BLOCK_ID:
        return NULL
    if block.ref_cnt > 0:
        return HELD_CACHED if block.key is not None else HELD
    return CACHED if block.key is not None else FREE


def check_against_engine(engine: LLMEngine) -> None:
    snapshot = take_snapshot(engine)
    pool, tables = engine.kv_manager.pool, engine.kv_manager.block_tables()
    blocks = snapshot.blocks
    assert blocks.group == 1 and blocks.num_blocks == pool.num_blocks
    assert blocks.states == [expected_state(b) for b in pool.blocks]
    assert blocks.held == [int(b.ref_cnt > 0) for b in pool.blocks]
    references = [0] * pool.num_blocks
    for table in tables.values():
        for block_id in table:
            references[block_id] += 1
    assert blocks.references == references
    assert [b.ref_cnt for b in pool.blocks] == references  # every reference is a table entry
    scheduler = engine.scheduler
    queued = [*scheduler.running, *scheduler.waiting]
    assert [r.request_id for r in snapshot.requests] == [r.request_id for r in queued]
    for view, request in zip(snapshot.requests, queued, strict=True):
        assert view.status == request.status.value
        assert view.computed_tokens == request.num_computed_tokens
        assert view.output_tokens == request.num_output_tokens
        assert view.blocks == len(tables.get(request.request_id, []))
        assert view.cells == sorted(set(tables.get(request.request_id, [])))
    for cell, owner in enumerate(blocks.owner):
        if owner >= 0:
            assert cell in snapshot.requests[owner].cells
        else:
            assert references[cell] == 0
    assert snapshot.kv["free_blocks"] == pool.num_free_blocks
    assert snapshot.config["num_blocks"] == pool.num_blocks


def test_snapshot_agrees_with_the_pool_and_scheduler_at_every_step(tiny_dir):
    engine = make_engine(tiny_dir, blocks=30)  # tight: requests wait and get preempted
    shared = list(range(3, 23))
    for i in range(6):
        prompt = shared + [30 + i] * (5 + 3 * i)
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=12, ignore_eos=True, n=2))
    phases: set[str] = set()
    statuses: set[str] = set()
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        check_against_engine(engine)
        snapshot = take_snapshot(engine)
        phases |= {r.phase for r in snapshot.requests}
        statuses |= {r.status for r in snapshot.requests}
    assert engine.scheduler.num_preemptions > 0
    assert {"prefill", "decode", "queued"} <= phases
    assert {"running", "waiting", "preempted"} <= statuses
    # Idle: every block free, the finished prompts' full blocks kept as cached prefixes.
    final = take_snapshot(engine)
    assert final.requests == []
    assert CACHED in final.blocks.states and HELD not in final.blocks.states
    assert final.blocks.states[NULL_BLOCK_ID] == NULL


def test_big_caches_are_drawn_in_groups(tiny_dir):
    engine = make_engine(tiny_dir, blocks=60)
    engine.add_request("a", list(range(3, 40)), SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()
    full = take_snapshot(engine)
    grouped = take_snapshot(engine, max_cells=8)
    group = grouped.blocks.group
    assert group == -(-engine.kv_manager.pool.num_blocks // 8)
    assert len(grouped.blocks.states) == -(-full.blocks.num_blocks // group)
    for cell, state in enumerate(grouped.blocks.states):
        members = full.blocks.states[cell * group : (cell + 1) * group]
        # A cell shows its most telling block: held before cached before free.
        assert state == min(members) or (state == NULL and set(members) <= {NULL, FREE})
        assert grouped.blocks.held[cell] == sum(full.blocks.held[cell * group : (cell + 1) * group])
    (view,) = grouped.requests
    assert view.cells == sorted({c // group for c in full.requests[0].cells})


def test_long_waiting_queues_are_counted_not_listed(tiny_dir):
    engine = make_engine(tiny_dir)
    for i in range(MAX_WAITING_SHOWN + 50):
        engine.add_request(f"w{i}", [5, 6, 7], SamplingParams(max_tokens=2))
    snapshot = take_snapshot(engine)
    assert snapshot.num_waiting == MAX_WAITING_SHOWN + 50
    assert [r.request_id for r in snapshot.requests] == [f"w{i}" for i in range(MAX_WAITING_SHOWN)]
    assert all(r.queued_s is not None and r.phase == "queued" for r in snapshot.requests)
    engine.abort_request([f"w{i}" for i in range(MAX_WAITING_SHOWN + 50)])


def test_history_carries_the_last_state_through_a_long_pause():
    history = StatusHistory(interval_s=2.0, span_s=20.0)
    history.record_step(1000.0, 10, 10, 0.8, 4, 1, 0, 0)
    assert history.to_json(1010.0)["kv_usage"][-1] == 0.8
    paused = history.to_json(1400.0)  # far beyond the window: nothing moved since
    assert set(paused["kv_usage"]) == {0.8} and set(paused["running"]) == {4}
    assert sum(paused["generation_tps"]) == 0


def test_history_rates_percentiles_and_expiry():
    history = StatusHistory(interval_s=2.0, span_s=10.0)
    history.record_step(100.5, 40, 4, 0.5, 2, 1, 10, 5)
    history.record_step(101.5, 0, 6, 0.6, 2, 0, 0, 0)
    for ms in (10, 20, 30, 40):
        history.record_itl(101.0, ms / 1e3)
    history.record_ttft(101.0, 0.25)
    data = history.to_json(105.0)
    assert len(data["t"]) == 5 and data["t"] == sorted(data["t"], reverse=True)
    i = data["t"].index(5.0)  # the bucket that started at t=100
    assert data["prompt_tps"][i] == 20.0 and data["generation_tps"][i] == 5.0
    assert data["prefix_hit_rate"][i] == 0.5
    assert data["itl_p50_ms"][i] == pytest.approx(20.0) and data["itl_p99_ms"][i] == 40.0
    assert data["ttft_p50_ms"][i] == 250.0
    # Idle buckets after it report no tokens and carry the last KV usage and queues.
    assert data["generation_tps"][i + 1 :] == [0.0] * (4 - i)
    assert data["kv_usage"][-1] == 0.6 and data["running"][-1] == 2
    assert data["itl_p50_ms"][-1] is None
    later = history.to_json(130.0)
    assert sum(later["generation_tps"]) == 0  # old buckets fall out of the window
    with pytest.raises(ValueError):
        StatusHistory(interval_s=0)
