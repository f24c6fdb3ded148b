"""State slots of a hybrid model's linear-attention layers, one per sequence that holds one.

Unlike KV blocks, a sequence's linear-layer state has a fixed size whatever its length, so
it needs exactly one slot from the time it is first scheduled until it finishes, is aborted
or is preempted (preemption drops the state; the recompute starts from zeros). Slot 0 is the
zero state every sequence at position 0 reads and is never handed out.

Invariants: a slot is free or held by exactly one request; `num_free + len(held) ==
num_slots`.
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

    @property
    def num_free(self) -> int:
        return len(self._free)

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
