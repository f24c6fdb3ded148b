"""Which adapter sits in which of the `max_loras` slots, and who is using it.

A running request holds its adapter's slot from admission to finish or preemption, so the
adapters of one step never outnumber the slots. A slot nobody uses keeps its adapter (a
later request finds it resident) until another adapter needs the room: the least recently
used idle slot is taken. A request whose adapter finds no idle slot waits. Each load the
runner must do before the step is queued as (slot, adapter id).
"""

from __future__ import annotations

from collections import OrderedDict


class LoRASlotTable:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._adapter_in: list[int | None] = [None] * num_slots
        self._users: list[set[str]] = [set() for _ in range(num_slots)]
        self._slot_of_request: dict[str, int] = {}
        # Idle slots, least recently used first.
        self._idle: OrderedDict[int, None] = OrderedDict((s, None) for s in range(num_slots))
        self._loads: list[tuple[int, int]] = []

    def slot_of(self, request_id: str) -> int:
        """The slot a request uses, -1 for none (the base model)."""
        return self._slot_of_request.get(request_id, -1)

    def resident(self, adapter_id: int) -> int | None:
        return next((s for s, a in enumerate(self._adapter_in) if a == adapter_id), None)

    def can_acquire(self, request_id: str, adapter_id: int) -> bool:
        return (
            request_id in self._slot_of_request
            or self.resident(adapter_id) is not None
            or bool(self._idle)
        )

    def acquire(self, request_id: str, adapter_id: int) -> int | None:
        """The slot `request_id` runs `adapter_id` in (loading it if needed), or None."""
        held = self._slot_of_request.get(request_id)
        if held is not None:
            return held
        slot = self.resident(adapter_id)
        if slot is None:
            if not self._idle:
                return None
            slot, _ = self._idle.popitem(last=False)
            self._adapter_in[slot] = adapter_id
            self._loads.append((slot, adapter_id))
        self._idle.pop(slot, None)
        self._users[slot].add(request_id)
        self._slot_of_request[request_id] = slot
        return slot

    def release(self, request_id: str) -> None:
        slot = self._slot_of_request.pop(request_id, None)
        if slot is None:
            return
        self._users[slot].discard(request_id)
        if not self._users[slot]:
            self._idle[slot] = None  # most recently used

    def reload(self, adapter_id: int) -> None:
        """The adapter's weights changed: load them again where it is resident."""
        slot = self.resident(adapter_id)
        if slot is not None:
            self._loads.append((slot, adapter_id))

    def evict(self, adapter_id: int) -> bool:
        """Forget a resident adapter nobody uses; False when requests still use it."""
        slot = self.resident(adapter_id)
        if slot is None:
            return True
        if self._users[slot]:
            return False
        self._adapter_in[slot] = None
        self._idle.move_to_end(slot, last=False)  # the first to be taken
        self._loads = [(s, a) for s, a in self._loads if s != slot]
        return True

    def take_loads(self) -> list[tuple[int, int]]:
        loads, self._loads = self._loads, []
        return loads

    def num_users(self) -> int:
        return len(self._slot_of_request)

    def residents(self) -> list[int | None]:
        return list(self._adapter_in)
