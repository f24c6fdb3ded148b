"""Part A: a three-request example, contiguous reservation against paged blocks, counted by
forklift's own `KVCacheManager`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from forklift.bench.memory.slots import SlotCount, slot_row
from forklift.bench.report import markdown_table
from forklift.core.kv_cache_manager import KVCacheManager, blocks_for_tokens

# The article's example, and the numbers its figures show.
SEED_REQUEST_TOKENS = (3, 5, 2)
SEED_MAX_LEN = 12
SEED_BLOCK_SIZE = 4
# Contiguous (reserved, used, unused, % wasted), paged (reserved, used, unused), slots freed.
SEED_EXPECTED = ((36, 10, 26, 72), (16, 10, 6), 20)


@dataclass(frozen=True)
class FigureResult:
    """The example under contiguous reservation and under paged blocks."""

    request_tokens: tuple[int, ...]
    max_len: int
    block_size: int
    contiguous: SlotCount
    paged: SlotCount
    freed_slots: int


def reserve_with_manager(reserve_tokens: Sequence[int], block_size: int) -> int:
    """Slots a `KVCacheManager` hands out when each request asks for `reserve_tokens[i]`."""
    needed = sum(blocks_for_tokens(n, block_size) for n in reserve_tokens)
    # One extra block: the pool keeps block 0 as the null block.
    manager = KVCacheManager(needed + 1, block_size)
    for index, tokens in enumerate(reserve_tokens):
        if not manager.allocate_slots(f"r{index}", tokens):
            raise RuntimeError(f"the cache ran out of blocks for request {index}")
    return sum(len(manager.block_table(f"r{i}")) for i in range(len(reserve_tokens))) * block_size


def seed_figures(
    request_tokens: Sequence[int] = SEED_REQUEST_TOKENS,
    max_len: int = SEED_MAX_LEN,
    block_size: int = SEED_BLOCK_SIZE,
) -> FigureResult:
    used = sum(request_tokens)
    # Contiguous reservation is paging with one block of max_len, reserved up front.
    contiguous = reserve_with_manager([max_len] * len(request_tokens), block_size=max_len)
    paged = reserve_with_manager(request_tokens, block_size=block_size)
    return FigureResult(
        request_tokens=tuple(request_tokens),
        max_len=max_len,
        block_size=block_size,
        contiguous=SlotCount.of(contiguous, used),
        paged=SlotCount.of(paged, used),
        freed_slots=contiguous - paged,
    )


def check_seed_figures(result: FigureResult) -> None:
    """The article's numbers must come out of forklift's allocator unchanged."""
    c, p = result.contiguous, result.paged
    got = (
        (c.reserved, c.used, c.unused, c.waste_percent),
        (p.reserved, p.used, p.unused),
        result.freed_slots,
    )
    if got != SEED_EXPECTED:
        raise RuntimeError(f"the example came out as {got}, expected {SEED_EXPECTED}")


def figures_markdown(f: FigureResult) -> list[str]:
    header = ["allocator", "reserved", "used", "unused", "wasted"]
    rows = [
        slot_row(f"contiguous (max {f.max_len} each)", f.contiguous),
        slot_row(f"paged (blocks of {f.block_size})", f.paged),
    ]
    return [
        "## A. A three-request example",
        "",
        f"Requests holding {', '.join(map(str, f.request_tokens))} tokens, max length "
        f"{f.max_len}, blocks of {f.block_size}; slots counted from forklift's `KVCacheManager`.",
        "",
        *markdown_table(header, rows),
        "",
        f"Contiguous reservation wastes {f.contiguous.unused} of {f.contiguous.reserved} slots "
        f"({f.contiguous.waste_percent}%). Paging reserves {f.paged.reserved} and frees "
        f"{f.freed_slots} slots for other requests.",
        "",
    ]
