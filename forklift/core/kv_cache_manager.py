"""Per-request block tables over the block pool, with automatic prefix caching."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from forklift.core.block_pool import NULL_BLOCK_ID, BlockKey, BlockPool
from forklift.core.state_checkpoints import StateCheckpoints

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


def window_start_block(num_tokens: int, window: int | None, block_size: int) -> int:
    """The first block a query at position `num_tokens` still reads through a window of
    `window` positions (0 without one): blocks before it never will again."""
    if window is None:
        return 0
    return max(num_tokens - window + 1, 0) // block_size


def window_blocks(window: int, max_chunk: int, block_size: int) -> int:
    """Most blocks a windowed group holds for one sequence: a chunk of `max_chunk` tokens
    and the window before its first one, straddling one more block boundary at worst."""
    return blocks_for_tokens(window - 1 + max_chunk, block_size) + 1


def blocks_per_sequence(
    num_tokens: int, windows: Sequence[int | None], block_size: int, chunk: int
) -> int:
    """Blocks one sequence of `num_tokens` tokens holds at most, over KV groups with these
    windows, while steps compute `chunk` of its tokens (1 for a decoding sequence)."""
    full = blocks_for_tokens(num_tokens, block_size)
    return sum(
        full if window is None else min(full, window_blocks(window, chunk, block_size))
        for window in windows
    )


class KVCacheManager:
    """Maps each request to the physical blocks that hold its K/V, growing on demand.

    Waste is under one block per request: only the last block of a table is partly empty.
    With `enable_prefix_caching`, full computed blocks are registered in the pool's index and
    a new request starts from the longest chain of cached blocks matching its tokens.

    A model's layers may fall into several groups (model/kv_layout.py), each with its own
    table per request over the one pool; `windows` gives each group's window (None: the
    whole context). Tables of all groups have the same length (a block index is a range of
    positions); a windowed group's blocks before its window go back to the pool and leave
    the null block in their place. The first group's table is "the" block table.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        windows: Sequence[int | None] = (None,),
    ):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if not windows:
            raise ValueError("a KV cache manager needs at least one group")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.windows = tuple(windows)
        self.pool = BlockPool(num_blocks)
        # One table per group for each request.
        self._tables: dict[str, list[list[int]]] = {}
        # Keys of each request's full blocks, in order, as far as they are computed.
        self._keys: dict[str, list[BlockKey]] = {}
        # Requests holding blocks computed before the last reset: never registered again.
        self._uncacheable: set[str] = set()
        # Prompt tokens looked up and found in the cache, over all admissions.
        self.num_query_tokens = 0
        self.num_hit_tokens = 0
        # A hybrid model's linear-layer state checkpoints, reset with the blocks.
        self.state_checkpoints: StateCheckpoints | None = None

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def block_table(self, request_id: str) -> list[int]:
        tables = self._tables.get(request_id)
        return tables[0] if tables else []

    def group_tables(self, request_id: str) -> list[list[int]]:
        """The request's table in every group (read-only views)."""
        return self._tables.get(request_id) or [[] for _ in self.windows]

    # ---- prefix cache --------------------------------------------------------------------
    def find_cached_prefix(self, token_ids: Sequence[int], extra_key: bytes = b"") -> list[int]:
        """Blocks holding the longest cached chain of full blocks of `token_ids` (the first
        group's; `lookup_prefix` gives every group's)."""
        return self.lookup_prefix(token_ids, extra_key)[0]

    def lookup_prefix(
        self, token_ids: Sequence[int], extra_key: bytes = b"", max_blocks: int | None = None
    ) -> list[list[int]]:
        """Each group's cached blocks for the longest prefix of full blocks of `token_ids`
        (at most `max_blocks` of them) that every group can serve: a group without a window
        needs every block of it, a windowed group only the blocks its window reaches from the
        prefix's end (the null block before them).

        The last token is never covered, so a request always computes at least one token
        and has logits to sample from.
        """
        return self.lookup_prefix_chain(token_ids, extra_key, max_blocks)[0]

    def lookup_prefix_chain(
        self, token_ids: Sequence[int], extra_key: bytes = b"", max_blocks: int | None = None
    ) -> tuple[list[list[int]], list[bytes]]:
        """`lookup_prefix`'s tables and the chain digests of the blocks they cover, in order
        (what a hybrid model's state checkpoints are filed under)."""
        empty: list[list[int]] = [[] for _ in self.windows]
        if not self.enable_prefix_caching:
            return empty, []
        size = self.block_size
        keys, first_hits = self._chain(token_ids, extra_key, max_blocks)
        hits = [first_hits] + [
            [self.pool.lookup(_group_key(key, group)) for key in keys]
            for group in range(1, self.num_groups)
        ]
        count = len(keys)
        for group, window in enumerate(self.windows):
            if window is None:  # a prefix of unbroken hits
                missing = [i for i, block in enumerate(hits[group]) if block is None]
                count = min(count, missing[0] if missing else count)
        while count > 0 and not self._window_hits(hits, count):
            count -= 1
        if count == 0:
            return empty, []
        tables = []
        for group, window in enumerate(self.windows):
            first = window_start_block(count * size, window, size)
            blocks = hits[group][first:count]
            tables.append([NULL_BLOCK_ID] * first + [b for b in blocks if b is not None])
        return tables, [key.digest for key in keys[:count]]

    def block_digest(self, request_id: str, index: int) -> bytes | None:
        """The chain digest of the request's block `index` once it is computed and cacheable;
        None before, or for a request computed before the last reset."""
        keys = self._keys.get(request_id)
        return keys[index].digest if keys is not None and index < len(keys) else None

    def _chain(
        self, token_ids: Sequence[int], extra_key: bytes, max_blocks: int | None = None
    ) -> tuple[list[BlockKey], list[int | None]]:
        """Keys of the full blocks before the last token (at most `max_blocks`) and the first
        group's hits for them. Where the first group reads the whole context, the chain stops
        at its first miss: no prefix can reach past it."""
        size = self.block_size
        stop_at_miss = self.windows[0] is None
        parent = _ROOT_DIGEST
        keys: list[BlockKey] = []
        hits: list[int | None] = []
        end = len(token_ids) - 1 - size + 1
        if max_blocks is not None:
            end = min(end, max_blocks * size - size + 1)
        for start in range(0, end, size):
            key = block_key(parent, token_ids[start : start + size], extra_key)
            block_id = self.pool.lookup(key)
            if block_id is None and stop_at_miss:
                break
            keys.append(key)
            hits.append(block_id)
            parent = key.digest
        return keys, hits

    def _window_hits(self, hits: list[list[int | None]], count: int) -> bool:
        """Every windowed group holds the blocks its window reaches from `count` blocks."""
        for group, window in enumerate(self.windows):
            if window is not None:
                first = window_start_block(count * self.block_size, window, self.block_size)
                if any(block is None for block in hits[group][first:count]):
                    return False
        return True

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
        tables = self._tables.get(request_id)
        if not tables:
            return
        keys = self._keys.setdefault(request_id, [])
        size = self.block_size
        num_full = min(num_computed_tokens // size, len(tables[0]))
        while len(keys) < num_full:
            index = len(keys)
            parent = keys[-1].digest if keys else _ROOT_DIGEST
            key = block_key(parent, token_ids[index * size : (index + 1) * size], extra_key)
            for group, table in enumerate(tables):
                if table[index] != NULL_BLOCK_ID:
                    self.pool.cache(table[index], _group_key(key, group))
            keys.append(key)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block (none is reused afterwards); returns how many.

        Blocks that running requests computed before the reset are never registered later,
        so nothing computed before it (say, with old weights) can be served after it.
        """
        self._keys.clear()
        self._uncacheable.update(self._tables)
        if self.state_checkpoints is not None:
            self.state_checkpoints.clear()
        return self.pool.reset_prefix_cache()

    # ---- tables --------------------------------------------------------------------------
    def block_tables(self) -> dict[str, list[int]]:
        """Every request's blocks (a read-only view: do not modify the lists); with several
        groups, all groups' blocks of a request in one list."""
        if self.num_groups == 1:
            return {rid: tables[0] for rid, tables in self._tables.items()}
        return {
            rid: [b for table in tables for b in table if b != NULL_BLOCK_ID]
            for rid, tables in self._tables.items()
        }

    def allocate_slots(
        self,
        request_id: str,
        num_total_tokens: int,
        cached_blocks: Sequence[int] | Sequence[Sequence[int]] = (),
        num_computed_tokens: int | None = None,
    ) -> bool:
        """Make room for `num_total_tokens` tokens of this request; False if blocks ran out.

        `cached_blocks` (only for a request without blocks yet) become the head of its
        tables: one list per group (`lookup_prefix`), or with one group its list. With
        `num_computed_tokens` (where this step's tokens start), windowed groups first return
        the blocks their window left behind. Nothing else changes when it returns False.
        """
        tables = self._tables.get(request_id)
        if tables is not None and not any(tables):
            tables = None  # empty tables: as good as none
        cached = _per_group(cached_blocks, self.num_groups)
        if any(cached) and tables and any(tables):
            raise ValueError(f"request {request_id!r} already has blocks; cannot add a prefix")
        if tables is not None and num_computed_tokens is not None:
            self._free_behind_windows(tables, num_computed_tokens)
        target = blocks_for_tokens(num_total_tokens, self.block_size)
        current = tables if tables else cached
        needed = [max(target - len(table), 0) for table in current]
        hits = [b for table in cached for b in table if b != NULL_BLOCK_ID]
        # Cache hits that sit in the free list stop being free once taken.
        available = self.pool.num_free_blocks - self.pool.count_free_among(hits)
        if sum(needed) > available:
            return False
        if hits:
            self.pool.touch(hits)
        if not tables:
            tables = [list(table) for table in cached]
        for table, count in zip(tables, needed, strict=True):
            table.extend(self.pool.allocate(count))
        self._tables[request_id] = tables
        return True

    def _free_behind_windows(self, tables: list[list[int]], num_computed_tokens: int) -> None:
        behind: list[int] = []
        for table, window in zip(tables, self.windows, strict=True):
            first = window_start_block(num_computed_tokens, window, self.block_size)
            for index in range(min(first, len(table))):
                if table[index] != NULL_BLOCK_ID:
                    behind.append(table[index])
                    table[index] = NULL_BLOCK_ID
        if behind:
            self.pool.free(behind)

    def can_share_prefix(self, source_id: str, num_blocks: int) -> bool:
        """`source` still holds its first `num_blocks` blocks as a sequence resuming after
        them reads them: False where a windowed group already returned one its window
        reaches."""
        sources = self._tables.get(source_id) or [[]]
        if len(sources[0]) < num_blocks:
            return False
        for table, window in zip(sources, self.windows, strict=False):
            first = window_start_block(num_blocks * self.block_size, window, self.block_size)
            if NULL_BLOCK_ID in table[first:num_blocks]:
                return False
        return True

    def share_prefix(self, source_id: str, target_id: str, num_blocks: int) -> None:
        """Give `target` (without blocks yet) the first `num_blocks` blocks of `source`
        (which `can_share_prefix` must allow)."""
        if self.block_table(target_id):
            raise ValueError(f"request {target_id!r} already has blocks")
        if len(self.block_table(source_id)) < num_blocks:
            raise ValueError(f"request {source_id!r} holds fewer than {num_blocks} blocks")
        if not self.can_share_prefix(source_id, num_blocks):
            raise ValueError(f"request {source_id!r} no longer holds {num_blocks} blocks to share")
        shared = [table[:num_blocks] for table in self._tables[source_id]]
        for table in shared:
            for block_id in table:
                if block_id != NULL_BLOCK_ID:
                    self.pool.share(block_id)
        self._tables[target_id] = shared

    def copy_tail_block(
        self, source_id: str, target_id: str, index: int
    ) -> list[tuple[int, int]] | None:
        """Give `target`, whose tables end at block `index`, a fresh block there in each group
        and return the (source's block, fresh block) pairs whose contents the runner must
        copy; None (nothing changes) when blocks ran out or `source` holds no such block."""
        sources = self._tables.get(source_id)
        targets = self._tables.get(target_id)
        if sources is None or targets is None or any(len(t) != index for t in targets):
            return None
        tails = [table[index] if len(table) > index else NULL_BLOCK_ID for table in sources]
        if NULL_BLOCK_ID in tails or self.pool.num_free_blocks < len(tails):
            return None
        copies = []
        for table, tail in zip(targets, tails, strict=True):
            (fresh,) = self.pool.allocate(1)
            table.append(fresh)
            copies.append((tail, fresh))
        return copies

    def release_tail(self, request_id: str, num_tokens: int) -> None:
        """Return the blocks past the first `num_tokens` tokens' to the pool (they held only
        rejected drafts, so none of them was registered in the prefix cache)."""
        keep = blocks_for_tokens(num_tokens, self.block_size)
        tail: list[int] = []
        for table in self._tables.get(request_id, ()):
            if len(table) > keep:
                tail += [b for b in table[keep:] if b != NULL_BLOCK_ID]
                del table[keep:]
        if tail:
            self.pool.free(tail)

    def free(self, request_id: str) -> None:
        self._keys.pop(request_id, None)
        self._uncacheable.discard(request_id)
        tables = self._tables.pop(request_id, None)
        if tables:
            blocks = [b for table in tables for b in table if b != NULL_BLOCK_ID]
            if blocks:
                self.pool.free(blocks)


def _group_key(key: BlockKey, group: int) -> BlockKey:
    """Group 0 keeps the chain's key; another group's block with the same tokens holds other
    layers, so it is cached under a key of its own."""
    if group == 0:
        return key
    return BlockKey(key.digest + bytes([group]), key.parent_digest, key.token_ids)


def _per_group(cached: Sequence[int] | Sequence[Sequence[int]], num_groups: int) -> list[list[int]]:
    if not cached:
        return [[] for _ in range(num_groups)]
    if isinstance(cached[0], int):
        if num_groups != 1:
            raise ValueError("cached blocks of a multi-group cache come one list per group")
        return [list(cached)]  # type: ignore[arg-type]
    return [list(table) for table in cached]  # type: ignore[arg-type]
