"""State slots of a hybrid model's linear-attention layers, one per sequence that holds one.

Unlike KV blocks, a sequence's linear-layer state has a fixed size whatever its length, so
it holds exactly one slot from the time it is first scheduled until it finishes, is aborted
or is preempted (preemption drops the state; the recompute starts from zeros); after a
verification of drafts, that slot may be another one (see below). Slot 0 is the
zero state every sequence at position 0 reads and is never handed out.

Speculation borrows spare slots for one step: a sequence verifying k drafts writes the
state after each of them to its own spare, and keeps the one after its last accepted token.

Invariants: a slot is free, held by exactly one request, or lent for the step;
`num_free + len(held) + num_lent == num_slots`.
"""

from __future__ import annotations


class StatePool:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"a state pool needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        # Lowest slot first, so a lightly loaded engine touches few slots.
        self._free = list(range(num_slots, 0, -1))
        self._held: dict[str, int] = {}
        self._lent: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_lent(self) -> int:
        return len(self._lent)

    def slot_of(self, request_id: str) -> int | None:
        return self._held.get(request_id)

    def allocate(self, request_id: str) -> int | None:
        """The request's slot, taking a free one if it has none; None when none is free."""
        slot = self._held.get(request_id)
        if slot is not None:
            return slot
        if not self._free:
            return None
        slot = self._free.pop()
        self._held[request_id] = slot
        return slot

    def free(self, request_id: str) -> None:
        """Give the request's slot back; a request without one is ignored."""
        slot = self._held.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)

    def lend(self, count: int) -> list[int]:
        """Up to `count` free slots for one step's verification."""
        lent = [self._free.pop() for _ in range(min(count, len(self._free)))]
        self._lent.update(lent)
        return lent

    def settle(self, request_id: str | None, lent: list[int], keep: int) -> None:
        """After the step: `keep` = 0 leaves the request its own slot; keep = j >= 1 makes
        lent slot j - 1 its slot instead (its old one is freed). Every other lent slot is
        freed; a request gone meanwhile (`None` or not holding a slot) keeps nothing."""
        if not self._lent.issuperset(lent):
            raise ValueError(f"slots {sorted(set(lent) - self._lent)} were not lent")
        self._lent.difference_update(lent)
        held = self._held.get(request_id) if request_id is not None else None
        if held is not None and keep > 0:
            self._held[request_id] = lent[keep - 1]  # type: ignore[index]
            self._free.append(held)
            lent = lent[: keep - 1] + lent[keep:]
        self._free.extend(lent)
