"""A picture of the engine between two steps: every KV block's state, the queues, the config.

Taken on the engine thread (nothing moves while it is read). Free blocks are the default, so
the cost follows the block tables and the prefix-cache index (vectorised) plus the cells
(at most MAX_CELLS), never a Python pass over every block of a big cache. Plain data, ready
for JSON: the status page draws it.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from forklift.core.block_pool import NULL_BLOCK_ID, BlockPool
from forklift.core.request import Request, RequestStatus

if TYPE_CHECKING:
    from forklift.engine.engine import LLMEngine

# Cell states, in the order a group of blocks shows them (the first one present wins).
HELD_CACHED = 0  # held by a request, and registered in the prefix cache
HELD = 1  # held by a request
CACHED = 2  # free, but holds a cached prefix a later request can take back
FREE = 3
NULL = 4  # block 0, never handed out
STATE_NAMES = ("held_cached", "held", "cached", "free", "null")

# Above this many blocks, cells stand for groups of consecutive blocks.
MAX_CELLS = 4096
# Waiting requests listed one by one; the rest are only counted.
MAX_WAITING_SHOWN = 200


@dataclass
class BlockMap:
    """One cell per block, or per `group` consecutive blocks on big caches."""

    group: int
    num_blocks: int
    states: list[int]  # STATE_NAMES index per cell
    held: list[int]  # blocks of the cell held by requests
    # Index into the snapshot's `requests` of the first holder of each cell (-1: none), and
    # how many block-table entries point into the cell (above `held` when blocks are shared).
    owner: list[int]
    references: list[int]


@dataclass
class RequestView:
    request_id: str
    status: str  # "running" | "waiting" | "preempted"
    phase: str  # "prefill" | "decode" | "queued"
    prompt_tokens: int
    output_tokens: int
    computed_tokens: int
    blocks: int
    age_s: float  # since arrival
    queued_s: float | None  # since it last joined the waiting queue; None while running
    preemptions: int
    cached_tokens: int
    cells: list[int] = field(default_factory=list)  # block-map cells its blocks fall in


@dataclass
class EngineSnapshot:
    time: float
    config: dict[str, Any]
    kv: dict[str, Any]
    blocks: BlockMap
    requests: list[RequestView] = field(default_factory=list)
    num_waiting: int = 0  # all of them, also those beyond MAX_WAITING_SHOWN

    def to_json(self) -> dict[str, Any]:
        # Built by hand: dataclasses.asdict deep-copies every list, which is most of the cost.
        return {
            "time": self.time,
            "config": self.config,
            "kv": self.kv,
            "blocks": vars(self.blocks),
            "requests": [vars(r) for r in self.requests],
            "num_waiting": self.num_waiting,
        }


def take_snapshot(engine: LLMEngine, max_cells: int = MAX_CELLS) -> EngineSnapshot:
    """Read the engine as it stands; call it between steps (on the engine thread)."""
    now = time.time()
    scheduler = engine.scheduler
    kv = engine.kv_manager
    # Running first (admission order), then the head of the waiting queue in its order.
    waiting = list(itertools.islice(scheduler.waiting, MAX_WAITING_SHOWN))
    queued: list[Request] = [*scheduler.running, *waiting]
    tables = kv.block_tables()
    requests = [_view(r, len(tables.get(r.request_id, ())), now) for r in queued]
    index = {r.request_id: i for i, r in enumerate(queued)}
    blocks = _block_map(kv.pool, tables, index, max_cells)
    for view in requests:
        view.cells = request_cells(tables.get(view.request_id, []), blocks.group)
    pool = kv.pool
    checkpoints = kv.state_checkpoints  # a hybrid model's, with prefix caching
    return EngineSnapshot(
        time=now,
        config=engine_config(engine),
        kv={
            "usable_blocks": pool.num_usable_blocks,
            "free_blocks": pool.num_free_blocks,
            "cached_blocks": pool.num_cached_blocks,
            "usage": pool.usage(),
            "evictions": pool.num_evictions,
            "preemptions": scheduler.num_preemptions,
            "state_checkpoints": checkpoints.num_checkpoints if checkpoints else 0,
            "state_checkpoint_slots": checkpoints.capacity if checkpoints else 0,
        },
        blocks=blocks,
        requests=requests,
        num_waiting=scheduler.num_waiting,
    )


def engine_config(engine: LLMEngine) -> dict[str, Any]:
    config = engine.config
    return {
        "model": str(engine.model_source.path.name),
        "architecture": engine.model_config.architecture,
        "dtype": str(engine.dtype).removeprefix("torch."),
        "quantization": engine.quantization,
        "decode_path": engine.runner.decode_path,
        "one_forward": engine.runner.one_forward,
        "weight_bytes": engine.runner.weight_bytes,
        "device": str(engine.device),
        "block_size": config.block_size,
        "num_blocks": engine.kv_plan.num_blocks,
        "kv_cache_dtype": engine.runner.kv_format.name,
        "kv_cache_tokens": engine.kv_plan.token_capacity,
        "kv_cache_bytes": engine.kv_plan.num_blocks * engine.kv_plan.bytes_per_block,
        "max_num_seqs": engine.scheduler.max_num_seqs,
        "max_num_batched_tokens": engine.scheduler.max_num_batched_tokens,
        "decode_step_prefill_tokens": engine.scheduler.decode_step_prefill_tokens,
        "prefill_pace_steps": engine.scheduler.prefill_pace_steps,
        "max_model_len": engine.max_model_len,
        "prefix_caching": engine.kv_manager.enable_prefix_caching,
        "speculative": _speculation(engine),
        "lora": _lora(engine),
        "weight_version": engine.weight_version,
        "sleep_level": engine.sleep_level,
    }


def _lora(engine: LLMEngine) -> dict[str, Any] | None:
    """The adapter slots (which adapter each holds) and the adapters loaded."""
    store, table = engine.runner.lora, engine.scheduler.lora_slots
    if engine.loras is None or store is None or table is None:
        return None
    infos = engine.loras.infos()
    names = {info.lora_int_id: info.name for info in infos}
    return {
        "max_loras": store.limits.max_loras,
        "max_lora_rank": store.limits.max_lora_rank,
        "slot_bytes": store.nbytes,
        "slots": [None if a is None else names.get(a) for a in table.residents()],
        "adapters": [vars(info) for info in infos],
    }


def _speculation(engine: LLMEngine) -> dict[str, Any] | None:
    """The method and its counters so far (the mean acceptance length the page shows)."""
    spec = engine.speculation
    if spec is None:
        return None
    stats = engine.spec_stats
    return {
        "method": spec.method,
        "num_speculative_tokens": spec.num_speculative_tokens,
        "num_drafts": stats.num_drafts,
        "num_draft_tokens": stats.num_draft_tokens,
        "num_accepted_tokens": stats.num_accepted_tokens,
        "mean_acceptance_length": stats.mean_acceptance_length,
    }


def _view(request: Request, num_blocks: int, now: float) -> RequestView:
    if request.status == RequestStatus.RUNNING:
        # A request computing all but its newest token is decoding; anything more is a
        # prompt chunk (or the recompute of a preempted request).
        decoding = request.num_computed_tokens >= request.num_tokens - 1
        phase = "decode" if decoding and request.num_output_tokens else "prefill"
        status = "running"
    else:
        phase = "queued"
        status = "preempted" if request.status == RequestStatus.PREEMPTED else "waiting"
    return RequestView(
        request_id=request.request_id,
        status=status,
        phase=phase,
        prompt_tokens=request.num_prompt_tokens,
        output_tokens=request.num_output_tokens,
        computed_tokens=request.num_computed_tokens,
        blocks=num_blocks,
        age_s=max(now - request.arrival_time, 0.0) if request.arrival_time else 0.0,
        queued_s=None if status == "running" else max(now - request.queued_time, 0.0),
        preemptions=request.num_preemptions,
        cached_tokens=request.num_cached_tokens,
    )


def _block_map(
    pool: BlockPool, tables: dict[str, list[int]], index: dict[str, int], max_cells: int
) -> BlockMap:
    """Vectorised: a few milliseconds for a 200k-block cache half held."""
    num_blocks = pool.num_blocks
    group = max(1, math.ceil(num_blocks / max_cells))
    cells = math.ceil(num_blocks / group)
    lengths = np.fromiter((len(t) for t in tables.values()), dtype=np.int64, count=len(tables))
    entries = np.fromiter(
        itertools.chain.from_iterable(tables.values()), dtype=np.int64, count=int(lengths.sum())
    )
    positions = np.repeat(
        np.fromiter((index.get(r, -1) for r in tables), dtype=np.int64, count=len(tables)),
        lengths,
    )
    # Per-block masks, padded to whole cells: every held block is in at least one table.
    held = np.zeros(cells * group, dtype=bool)
    held[entries] = True
    cached = np.zeros(cells * group, dtype=bool)
    cached[pool.cached_block_ids()] = True
    block_states = np.full(cells * group, FREE, dtype=np.int8)
    block_states[cached] = CACHED
    block_states[held] = HELD
    block_states[held & cached] = HELD_CACHED
    # A cell keeps its most telling state (the lowest number): held, then cached, then free.
    states = block_states.reshape(cells, group).min(axis=1).astype(np.int64)
    if states[NULL_BLOCK_ID // group] == FREE:
        states[NULL_BLOCK_ID // group] = NULL
    entry_cells = entries // group
    owner = np.full(cells, -1, dtype=np.int64)
    first_cells, first_entry = np.unique(entry_cells, return_index=True)
    owner[first_cells] = positions[first_entry]
    return BlockMap(
        group,
        num_blocks,
        states.tolist(),
        held.reshape(cells, group).sum(axis=1).tolist(),
        owner.tolist(),
        np.bincount(entry_cells, minlength=cells).tolist(),
    )


def request_cells(table: list[int], group: int) -> list[int]:
    """The block-map cells a request's blocks fall in, ascending."""
    return np.unique(np.asarray(table, dtype=np.int64) // group).tolist()
