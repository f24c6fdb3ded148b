"""Part B: one KV budget, one workload, two allocators, at the real model's size."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

from forklift.bench.kv_calc import dtype_bytes, kv_cache_bytes
from forklift.bench.memory.slots import SlotCount, slot_row
from forklift.bench.report import markdown_table
from forklift.core.kv_cache_manager import blocks_for_tokens
from forklift.model.model_config import ModelConfig

SCALE_BLOCK_SIZE = 16
# The default at-scale budget holds this many requests of max_model_len.
SCALE_CONTIGUOUS_REQUESTS = 16
SCALE_SEED = 0


@dataclass(frozen=True)
class ScaleSide:
    requests_in_flight: int
    slots: SlotCount


@dataclass(frozen=True)
class ScaleResult:
    """One KV budget, one workload, two allocators."""

    model: str
    dtype: str
    bytes_per_token: int
    budget_bytes: int
    budget_tokens: int
    max_model_len: int
    block_size: int
    workload: str
    mean_request_len: float
    contiguous: ScaleSide
    paged: ScaleSide
    # How many times more requests paging keeps in flight.
    gain: float


def scale_lengths(max_model_len: int, seed: int) -> Iterator[int]:
    """An endless stream of prompt + output lengths, mostly far below max_model_len."""
    rng = random.Random(seed)
    while True:
        prompt = rng.randint(max(1, max_model_len // 128), max(1, max_model_len // 4))
        output = rng.randint(max(1, max_model_len // 256), max(1, max_model_len // 8))
        yield prompt + output


def admit_paged(lengths: Iterator[int], num_blocks: int, block_size: int) -> list[int]:
    """First-come first-served: admit requests until the next one's blocks do not fit."""
    admitted: list[int] = []
    free = num_blocks
    for length in lengths:
        need = blocks_for_tokens(length, block_size)
        if need > free:
            return admitted
        free -= need
        admitted.append(length)
    return admitted


def at_scale(
    config: ModelConfig,
    model_name: str,
    budget_bytes: int | None = None,
    block_size: int = SCALE_BLOCK_SIZE,
    seed: int = SCALE_SEED,
) -> ScaleResult:
    """Requests in flight under one KV budget: reserve max_model_len each, or pay per block.

    Each request counts at its final length (prompt + all output), paging's fullest moment.
    """
    # The dtype a GPU serves in; it scales bytes, not the comparison.
    dtype = "bfloat16"
    max_len = config.max_position_embeddings
    per_token = kv_cache_bytes(
        config.num_layers, config.num_kv_heads, config.head_dim, 1, dtype_bytes(dtype)
    )
    if budget_bytes is None:
        budget_bytes = per_token * max_len * SCALE_CONTIGUOUS_REQUESTS
    budget_tokens = budget_bytes // per_token
    if budget_tokens < max_len:
        raise ValueError(
            f"a KV budget of {budget_bytes} bytes holds {budget_tokens} tokens, less than one "
            f"request of max_model_len={max_len}"
        )
    paged = admit_paged(scale_lengths(max_len, seed), budget_tokens // block_size, block_size)
    num_contiguous = budget_tokens // max_len
    lengths = scale_lengths(max_len, seed)
    contiguous = [next(lengths) for _ in range(num_contiguous)]
    paged_reserved = sum(blocks_for_tokens(n, block_size) for n in paged) * block_size
    return ScaleResult(
        model=model_name,
        dtype=dtype,
        bytes_per_token=per_token,
        budget_bytes=budget_bytes,
        budget_tokens=budget_tokens,
        max_model_len=max_len,
        block_size=block_size,
        workload=(
            f"seeded RNG ({seed}): prompt in [{max_len // 128}, {max_len // 4}] + output in "
            f"[{max_len // 256}, {max_len // 8}] tokens"
        ),
        mean_request_len=sum(paged) / len(paged),
        contiguous=ScaleSide(
            num_contiguous, SlotCount.of(num_contiguous * max_len, sum(contiguous))
        ),
        paged=ScaleSide(len(paged), SlotCount.of(paged_reserved, sum(paged))),
        gain=len(paged) / num_contiguous,
    )


def scale_markdown(s: ScaleResult) -> list[str]:
    header = ["allocator", "reserved tokens", "used tokens", "unused", "wasted", "in flight"]
    rows = [
        slot_row(
            f"contiguous ({s.max_model_len} each)",
            s.contiguous.slots,
            s.contiguous.requests_in_flight,
        ),
        slot_row(f"paged (blocks of {s.block_size})", s.paged.slots, s.paged.requests_in_flight),
    ]
    return [
        "## B. At scale",
        "",
        f"{s.model}: {s.bytes_per_token:,} KV bytes per token in {s.dtype}; budget "
        f"{s.budget_bytes / 2**30:.2f} GiB = {s.budget_tokens:,} tokens; max_model_len "
        f"{s.max_model_len}. Workload: {s.workload} (mean {s.mean_request_len:.0f} tokens); "
        "each request counted at its final length.",
        "",
        *markdown_table(header, rows),
        "",
        f"Paging keeps {s.gain:.1f}x as many requests in flight.",
        "",
    ]
