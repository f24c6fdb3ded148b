"""Per-request block tables over the block pool."""

from __future__ import annotations

from forklift.engine.block_pool import BlockPool


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class KVCacheManager:
    """Maps each request to the physical blocks that hold its K/V, growing on demand.

    Waste is under one block per request: only the last block of a table is partly empty.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self._tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def allocate_slots(self, request_id: str, num_total_tokens: int) -> bool:
        """Make room for `num_total_tokens` tokens of this request; False if blocks ran out."""
        table = self._tables.setdefault(request_id, [])
        needed = blocks_for_tokens(num_total_tokens, self.block_size) - len(table)
        if needed <= 0:
            return True
        if needed > self.pool.num_free_blocks:
            return False
        table.extend(self.pool.allocate(needed))
        return True

    def free(self, request_id: str) -> None:
        table = self._tables.pop(request_id, None)
        if table:
            self.pool.free(table)
