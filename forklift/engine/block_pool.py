"""Physical KV-cache blocks: reference counts and a free list.

Block 0 is the null block: it is never handed out, stays zeroed, and pads gathers so that
attention never reads memory no request has written.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

NULL_BLOCK_ID = 0


@dataclass
class KVBlock:
    block_id: int
    ref_cnt: int = 0


class BlockPool:
    """Hands out fixed-size blocks; freed blocks go to the back of the free list (LRU order)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks must be at least 2 (one is the null block), got {num_blocks}"
            )
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: deque[int] = deque(range(1, num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def usage(self) -> float:
        """Fraction of usable blocks currently held by requests."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise MemoryError(f"asked for {count} KV blocks, only {len(self._free)} free")
        ids = [self._free.popleft() for _ in range(count)]
        for block_id in ids:
            self.blocks[block_id].ref_cnt = 1
        return ids

    def share(self, block_id: int) -> None:
        """Add a reference to a block already held by another sequence."""
        block = self.blocks[block_id]
        if block.ref_cnt <= 0:
            raise ValueError(f"block {block_id} is free and cannot be shared")
        block.ref_cnt += 1

    def free(self, block_ids: list[int]) -> None:
        # Free in reverse so a request's tail blocks are reused last: its head blocks are the
        # ones most likely to be shared by a later prefix.
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block_id} freed twice")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free.append(block_id)
