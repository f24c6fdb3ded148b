"""Checkpoints of a hybrid model's linear-layer states at block boundaries: prefix caching for
the hybrid family.

A hybrid's attention layers keep K/V in blocks like any model's, and those blocks are cached
as usual. Its linear layers carry one fixed-size state per sequence instead, which no block
can rebuild, so a prefix hit needs the state where the prefix ends. A checkpoint is a copy of
a sequence's state slot made when its computation stood exactly at a block boundary, kept in
a slot of its own (past the running sequences' slots, in the same tensors) and found by the
digest of the block chain up to that boundary, which carries the cache salt, adapter and
weight version along with the tokens. A hit resumes from the latest checkpoint at or before
the longest cached prefix and recomputes the rest.

Boundaries, chosen so the common cases hit (`CheckpointPlan`); a prompt stops for one only
`min_tokens` or more past where the request started:
- the end of the prompt's full blocks before its last token: the same prompt again (and, at
  any length, the fork of `n > 1` samples, where the prompt stops anyway: core/scheduler.py);
- every `interval` tokens inside a long prompt, so a long shared document costs at most
  `interval` tokens of recompute to the second request that shares it;
- a branch point: a request whose cached K/V reach past its latest checkpoint (a shared
  system prompt followed by other text) leaves a checkpoint where the cached blocks end, and
  the requests after it resume there;
- the last boundary a sequence reached when it ends (the next chat turn starts there): while
  it decodes, every boundary it lands on overwrites one held slot, which is filed under its
  digest when the sequence finishes.

A prompt chunk stops at each of its boundaries, so a request that misses computes the same
chunks as a later one that hits and resumes at one of them. Checkpoints are evicted least
recently used, those hit at most once before those hit again (a segmented LRU); resetting the
prefix cache drops them all.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

# Tokens between checkpoints inside a long prompt (rounded down to whole blocks).
DEFAULT_INTERVAL_TOKENS = 1024
# No prompt stops for a checkpoint before this many tokens: computing a shorter prefix again
# costs about what stopping costs every request that misses (one more step).
MIN_CHECKPOINT_TOKENS = 256
# Checkpoint slots take at most 1 / this of the KV cache's memory budget.
CHECKPOINT_BUDGET_SHARE = 8


@dataclass(frozen=True)
class CheckpointPlan:
    """Where one request's prompt stops for a checkpoint."""

    block_size: int
    interval: int
    num_prompt_tokens: int
    # Where the request's cached K/V ended when it was admitted (0: nowhere to mark).
    branch: int = 0
    min_tokens: int = MIN_CHECKPOINT_TOKENS
    # Where it resumed from a checkpoint: it stops only where that saves `min_tokens` more.
    resumed_at: int = 0

    @property
    def prompt_end(self) -> int:
        """The end of the full blocks before the prompt's last token (0: none)."""
        return (self.num_prompt_tokens - 1) // self.block_size * self.block_size

    def is_boundary(self, position: int) -> bool:
        """Whether the prompt keeps a checkpoint at `position` (a block boundary)."""
        if position < max(self.resumed_at + self.min_tokens, 1) or position > self.prompt_end:
            return False
        return position in (self.prompt_end, self.branch) or position % self.interval == 0

    def next_boundary(self, start: int) -> int | None:
        """The first checkpoint boundary after `start`, or None past the prompt's last one."""
        end = self.prompt_end
        first = max(start + 1, self.resumed_at + self.min_tokens)
        if first > end:
            return None
        candidates = [end, -(-first // self.interval) * self.interval]
        if first <= self.branch <= end:
            candidates.append(self.branch)
        return min(c for c in candidates if c <= end)


@dataclass
class _Held:
    """A running sequence's slot for the last boundary it reached past its prompt."""

    slot: int
    digest: bytes | None = None


class StateCheckpoints:
    """The checkpoint slots: an index from chain digest to slot, evicted least recently used
    as a segmented LRU (checkpoints hit at most once before those hit again, which keep at
    most half the slots), plus one held slot per sequence decoding past its prompt (at most
    half the slots). Every slot is free, indexed, or held."""

    def __init__(
        self,
        slots: Sequence[int],
        block_size: int,
        interval: int = DEFAULT_INTERVAL_TOKENS,
        min_tokens: int = MIN_CHECKPOINT_TOKENS,
    ) -> None:
        if not slots:
            raise ValueError("state checkpoints need at least one slot")
        self.block_size = block_size
        self.interval = max(interval // block_size, 1) * block_size
        self.min_tokens = min_tokens
        self.slots = tuple(slots)
        self.capacity = len(slots)
        # The most slots checkpoints hit again keep, and the most decoding sequences hold.
        self._half = max(self.capacity // 2, 1)
        self._free = list(reversed(slots))
        # Least recently used first: checkpoints hit at most once, and those hit again (at
        # most half the slots). A slot is taken from the first while it has any, so requests'
        # own prompt ends never push out a system prompt's checkpoint that others resume from.
        self._fresh: OrderedDict[bytes, int] = OrderedDict()
        self._reused: OrderedDict[bytes, int] = OrderedDict()
        self._hit_once: set[bytes] = set()  # checkpoints among the first hit once so far
        self._held: dict[str, _Held] = {}
        # Per admitted request: (where it resumed, where its cached blocks ended).
        self._admitted: dict[str, tuple[int, int]] = {}

    @property
    def num_checkpoints(self) -> int:
        return len(self._fresh) + len(self._reused)

    def plan(self, request_id: str, num_prompt_tokens: int) -> CheckpointPlan:
        resumed_at, branch = self._admitted.get(request_id, (0, 0))
        return CheckpointPlan(
            self.block_size, self.interval, num_prompt_tokens, branch, self.min_tokens, resumed_at
        )

    def lookup(self, digest: bytes) -> int | None:
        """The slot holding the state after the chain `digest` ends, marked recently used.
        A checkpoint hit a second time (a shared system prompt's, not a chat turn's, which
        only the next turn reads) joins the reused ones, at most half the slots: past that
        the least recently used of them goes back among the others, first to be evicted (a
        segmented LRU)."""
        slot = self._fresh.get(digest)
        if slot is not None and digest not in self._hit_once:
            self._hit_once.add(digest)
            self._fresh.move_to_end(digest)
            return slot
        if slot is not None:
            del self._fresh[digest]
            self._hit_once.discard(digest)
            self._reused[digest] = slot
            if len(self._reused) > self._half:
                demoted, demoted_slot = self._reused.popitem(last=False)
                self._fresh[demoted] = demoted_slot
                self._fresh.move_to_end(demoted, last=False)
            return slot
        slot = self._reused.get(digest)
        if slot is not None:
            self._reused.move_to_end(digest)
        return slot

    def admitted(self, request_id: str, cached_end: int, resumed_at: int) -> None:
        """A request admitted with K/V cached up to `cached_end` resumes at `resumed_at`: where
        they differ, its prompt leaves a checkpoint at the cached end (a branch point)."""
        self._admitted[request_id] = (resumed_at, cached_end if cached_end > resumed_at else 0)

    def reserve(self, digest: bytes) -> int | None:
        """A slot to copy a new checkpoint into, filed under `digest`; None when that chain
        has one already or every slot is held."""
        if self._touch(digest):
            return None
        slot = self._take()
        if slot is not None:
            self._fresh[digest] = slot
        return slot

    def hold(self, request_id: str, digest: bytes) -> int | None:
        """The request's held slot, now standing for the chain `digest` (its contents are
        about to be overwritten); None where that chain has a checkpoint already or no slot
        can be had. At most half the slots are held, so sequences decoding at once never
        evict every checkpoint they might share."""
        held = self._held.get(request_id)
        if self._touch(digest):
            if held is not None:
                held.digest = None  # an earlier boundary: not worth filing at the end
            return None
        if held is None:
            if len(self._held) >= self._half:
                return None
            slot = self._take()
            if slot is None:
                return None
            held = self._held[request_id] = _Held(slot)
        held.digest = digest
        return held.slot

    def release(self, request_id: str) -> None:
        """The request is done (finished, aborted or preempted): its held slot is filed
        under the last boundary it reached, or freed where that chain has a checkpoint."""
        self._admitted.pop(request_id, None)
        held = self._held.pop(request_id, None)
        if held is None:
            return
        if held.digest is None or self._touch(held.digest):
            self._free.append(held.slot)
        else:
            self._fresh[held.digest] = held.slot

    def clear(self) -> int:
        """Forget every checkpoint (the prefix cache was reset); returns how many. Held slots
        stay with their sequences but are freed, not filed, when those end."""
        dropped = self.num_checkpoints
        for index in (self._fresh, self._reused):
            self._free.extend(index.values())
            index.clear()
        self._hit_once.clear()
        for held in self._held.values():
            held.digest = None
        return dropped

    def _touch(self, digest: bytes) -> bool:
        """Whether the chain `digest` has a checkpoint (now marked recently used)."""
        for index in (self._fresh, self._reused):
            if digest in index:
                index.move_to_end(digest)
                return True
        return False

    def _take(self) -> int | None:
        """A free slot, or the least recently used checkpoint's (one hit at most once first)."""
        if self._free:
            return self._free.pop()
        if self._fresh:
            digest, slot = self._fresh.popitem(last=False)
            self._hit_once.discard(digest)
            return slot
        if self._reused:
            return self._reused.popitem(last=False)[1]
        return None
