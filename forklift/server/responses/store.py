"""Stored responses of POST /v1/responses, for `previous_response_id`, GET and DELETE.

In memory only, and bounded: past the capacity the least recently used response goes, and a
request that names it gets a 404, as for an id that never existed."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StoredResponse:
    # The response object, as POST returned it.
    response: dict[str, Any]
    # The whole conversation up to and including this response's output, as normalized
    # input items (forklift/server/responses/input.py); instructions are not part of it.
    items: list[dict[str, Any]]


class ResponseStore:
    """An LRU map of response id -> StoredResponse. Used on the event loop only."""

    def __init__(self, capacity: int = 1000) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, stored: StoredResponse) -> None:
        self._entries[response_id] = stored
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._entries.get(response_id)
        if stored is not None:
            self._entries.move_to_end(response_id)  # continued or read: recently used
        return stored

    def delete(self, response_id: str) -> bool:
        return self._entries.pop(response_id, None) is not None
