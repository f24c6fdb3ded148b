"""Per-request block tables over the block pool, with automatic prefix caching."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from forklift.core.block_pool import BlockKey, BlockPool

_ROOT_DIGEST = b""


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def block_key(parent_digest: bytes, token_ids: Sequence[int], extra_key: bytes) -> BlockKey:
    """Chain a block's identity from its parent's digest, its tokens and the extra keys.

    The extra key (cache salt, weight version) enters every link, so two chains that differ
    in it never meet.
    """
    tokens = tuple(token_ids)
    digest = hashlib.blake2b(digest_size=16)
    digest.update(parent_digest)
    digest.update(extra_key)
    digest.update(array("q", tokens).tobytes())
    return BlockKey(digest.digest(), parent_digest, tokens)


class KVCacheManager:
    """Maps each request to the physical blocks that hold its K/V, growing on demand.

    Waste is under one block per request: only the last block of a table is partly empty.
    With `enable_prefix_caching`, full computed blocks are registered in the pool's index and
    a new request starts from the longest chain of cached blocks matching its tokens.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self._tables: dict[str, list[int]] = {}
        # Keys of each request's full blocks, in order, as far as they are computed.
        self._keys: dict[str, list[BlockKey]] = {}
        # Requests holding blocks computed before the last reset: never registered again.
        self._uncacheable: set[str] = set()
        # Prompt tokens looked up and found in the cache, over all admissions.
        self.num_query_tokens = 0
        self.num_hit_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    # ---- prefix cache --------------------------------------------------------------------
    def find_cached_prefix(self, token_ids: Sequence[int], extra_key: bytes = b"") -> list[int]:
        """Blocks holding the longest cached chain of full blocks of `token_ids`.

        The last token is never covered, so a request always computes at least one token
        and has logits to sample from.
        """
        if not self.enable_prefix_caching:
            return []
        size = self.block_size
        parent = _ROOT_DIGEST
        hits = []
        for start in range(0, len(token_ids) - 1 - size + 1, size):
            key = block_key(parent, token_ids[start : start + size], extra_key)
            block_id = self.pool.lookup(key)
            if block_id is None:
                break
            hits.append(block_id)
            parent = key.digest
        return hits

    def record_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.num_query_tokens += num_query_tokens
        self.num_hit_tokens += num_hit_tokens

    def cache_full_blocks(
        self,
        request_id: str,
        token_ids: Sequence[int],
        num_computed_tokens: int,
        extra_key: bytes = b"",
    ) -> None:
        """Register the request's blocks that became full and computed since the last call."""
        if not self.enable_prefix_caching or request_id in self._uncacheable:
            return
        table = self._tables.get(request_id, [])
        keys = self._keys.setdefault(request_id, [])
        size = self.block_size
        num_full = min(num_computed_tokens // size, len(table))
        while len(keys) < num_full:
            index = len(keys)
            parent = keys[-1].digest if keys else _ROOT_DIGEST
            key = block_key(parent, token_ids[index * size : (index + 1) * size], extra_key)
            self.pool.cache(table[index], key)
            keys.append(key)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block (none is reused afterwards); returns how many.

        Blocks that running requests computed before the reset are never registered later,
        so nothing computed before it (say, with old weights) can be served after it.
        """
        self._keys.clear()
        self._uncacheable.update(self._tables)
        return self.pool.reset_prefix_cache()

    # ---- tables --------------------------------------------------------------------------
    def block_tables(self) -> dict[str, list[int]]:
        """Every request's block table (a read-only view: do not modify the lists)."""
        return self._tables

    def allocate_slots(
        self, request_id: str, num_total_tokens: int, cached_blocks: Sequence[int] = ()
    ) -> bool:
        """Make room for `num_total_tokens` tokens of this request; False if blocks ran out.

        `cached_blocks` (only for a request without blocks yet) become the head of its table.
        Nothing changes when it returns False.
        """
        table = self._tables.get(request_id, [])
        if cached_blocks and table:
            raise ValueError(f"request {request_id!r} already has blocks; cannot add a prefix")
        held = len(table) + len(cached_blocks)
        needed = max(blocks_for_tokens(num_total_tokens, self.block_size) - held, 0)
        # Cache hits that sit in the free list stop being free once taken.
        available = self.pool.num_free_blocks - self.pool.count_free_among(list(cached_blocks))
        if needed > available:
            return False
        if cached_blocks:
            self.pool.touch(list(cached_blocks))
            table = list(cached_blocks)
        table.extend(self.pool.allocate(needed))
        self._tables[request_id] = table
        return True

    def share_prefix(self, source_id: str, target_id: str, num_blocks: int) -> None:
        """Give `target` (without blocks yet) the first `num_blocks` blocks of `source`."""
        if self._tables.get(target_id):
            raise ValueError(f"request {target_id!r} already has blocks")
        shared = self._tables[source_id][:num_blocks]
        if len(shared) != num_blocks:
            raise ValueError(f"request {source_id!r} holds fewer than {num_blocks} blocks")
        for block_id in shared:
            self.pool.share(block_id)
        self._tables[target_id] = list(shared)

    def release_tail(self, request_id: str, num_tokens: int) -> None:
        """Return the blocks past the first `num_tokens` tokens' to the pool (they held only
        rejected drafts, so none of them was registered in the prefix cache)."""
        table = self._tables.get(request_id)
        keep = blocks_for_tokens(num_tokens, self.block_size)
        if table and len(table) > keep:
            tail = table[keep:]
            del table[keep:]
            self.pool.free(tail)

    def free(self, request_id: str) -> None:
        self._keys.pop(request_id, None)
        self._uncacheable.discard(request_id)
        table = self._tables.pop(request_id, None)
        if table:
            self.pool.free(table)
