"""Physical KV-cache blocks: reference counts, an LRU free list and the prefix-cache index.

Block 0 is the null block: it is never handed out, stays zeroed, and pads gathers so that
attention never reads memory no request has written.

A full block whose K/V are computed can be registered under its `BlockKey` (a digest chained
from its parent's). When its last owner frees it, it keeps its contents and its key and goes
to the back of the free list; a later request with the same tokens can take it back from
there. Only when the block is handed out for new contents is its key forgotten (eviction).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import overload

NULL_BLOCK_ID = 0


@dataclass(frozen=True)
class BlockKey:
    """What a cached block holds: its chained digest and, for verification, its tokens."""

    digest: bytes
    parent_digest: bytes
    token_ids: tuple[int, ...]


@dataclass
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    key: BlockKey | None = None


class _Blocks(Sequence[KVBlock]):
    """Every block's bookkeeping, made on first access: a small model under a large memory
    budget has millions of blocks, whose objects took seconds of start-up to build."""

    def __init__(self, count: int) -> None:
        self._count = count
        self._made: list[KVBlock] = []

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, index: int) -> KVBlock: ...

    @overload
    def __getitem__(self, index: slice) -> list[KVBlock]: ...

    def __getitem__(self, index: int | slice) -> KVBlock | list[KVBlock]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._count))]
        if index < 0:
            index += self._count
        if not 0 <= index < self._count:
            raise IndexError(f"block {index} out of range")
        made = self._made
        if index >= len(made):
            made.extend(KVBlock(i) for i in range(len(made), index + 1))
        return made[index]


class BlockPool:
    """Hands out fixed-size blocks; freed blocks go to the back of the free list (LRU order).

    The free list starts as every block in id order; blocks never handed out yet stay out of
    it as a range (`_next_fresh` onwards) that precedes every freed block, so a pool of any
    size is built at once and hands blocks out in the same order."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks must be at least 2 (one is the null block), got {num_blocks}"
            )
        self.num_blocks = num_blocks
        self.blocks = _Blocks(num_blocks)
        self._next_fresh = NULL_BLOCK_ID + 1
        # Insertion order is eviction order: the front is the least recently freed block.
        self._free: OrderedDict[int, None] = OrderedDict()
        self._cached: dict[bytes, int] = {}
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return self.num_blocks - self._next_fresh + len(self._free)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def usage(self) -> float:
        """Fraction of usable blocks currently held by requests."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def allocate(self, count: int) -> list[int]:
        """Take `count` blocks from the front of the free list, evicting cached contents."""
        if count > self.num_free_blocks:
            raise MemoryError(f"asked for {count} KV blocks, only {self.num_free_blocks} free")
        ids = []
        for _ in range(count):
            if self._next_fresh < self.num_blocks:
                block_id = self._next_fresh
                self._next_fresh += 1
                block = self.blocks[block_id]
            else:
                block_id, _ = self._free.popitem(last=False)
                block = self.blocks[block_id]
                if block.key is not None:
                    self._forget(block)
                    self.num_evictions += 1
            block.ref_cnt = 1
            ids.append(block_id)
        return ids

    def share(self, block_id: int) -> None:
        """Add a reference to a block already held by another sequence."""
        block = self.blocks[block_id]
        if block.ref_cnt <= 0:
            raise ValueError(f"block {block_id} is free and cannot be shared")
        block.ref_cnt += 1

    def touch(self, block_ids: list[int]) -> None:
        """Take references to cache hits, pulling free ones back out of the free list."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                if block.key is None:
                    raise ValueError(f"block {block_id} is free and holds no cached contents")
                del self._free[block_id]
            block.ref_cnt += 1

    def free(self, block_ids: list[int]) -> None:
        # Free in reverse so a request's tail blocks are evicted first: its head blocks are
        # the ones most likely to be shared by a later prefix.
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block_id} freed twice")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block_id] = None

    # ---- prefix cache --------------------------------------------------------------------
    def lookup(self, key: BlockKey) -> int | None:
        """The block cached under `key`, checked token by token (not only by digest)."""
        block_id = self._cached.get(key.digest)
        if block_id is None:
            return None
        return block_id if self.blocks[block_id].key == key else None

    def cache(self, block_id: int, key: BlockKey) -> None:
        """Register a held, fully computed block. The first block cached under a key wins."""
        block = self.blocks[block_id]
        if block.ref_cnt <= 0:
            raise ValueError(f"block {block_id} is free and cannot be cached")
        if block.key is not None or key.digest in self._cached:
            return
        block.key = key
        self._cached[key.digest] = block_id

    def cached_block_ids(self) -> list[int]:
        """Every block registered in the prefix cache, held or free."""
        return list(self._cached.values())

    def count_free_among(self, block_ids: list[int]) -> int:
        """How many of these (cache-hit) blocks sit in the free list right now."""
        return sum(1 for b in dict.fromkeys(block_ids) if self.blocks[b].ref_cnt == 0)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block; contents already in use stay with their owners."""
        dropped = len(self._cached)
        for block_id in self._cached.values():
            self.blocks[block_id].key = None
        self._cached.clear()
        return dropped

    def _forget(self, block: KVBlock) -> None:
        assert block.key is not None
        if self._cached.get(block.key.digest) == block.block_id:
            del self._cached[block.key.digest]
        block.key = None
