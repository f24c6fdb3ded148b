"""The engine's unfinished requests: each request (one prompt and its n sequences) by id, each
sequence by id, and the ids the engine hands out to requests that bring none."""

from __future__ import annotations

from forklift.engine.output_processor import OutputSequence, ParentRequest


def sequence_ids(request_id: str, n: int) -> list[str]:
    """The ids of a request's n sequences: its own when n is 1, else "<id>#<index>"."""
    return [request_id] if n == 1 else [f"{request_id}#{i}" for i in range(n)]


class RequestTable:
    def __init__(self) -> None:
        self._parents: dict[str, ParentRequest] = {}
        self._sequences: dict[str, tuple[ParentRequest, OutputSequence]] = {}
        self._last_id = 0

    def __len__(self) -> int:
        return len(self._parents)

    def parent(self, request_id: str) -> ParentRequest:
        """The unfinished request `request_id` (KeyError for one finished or unknown)."""
        return self._parents[request_id]

    def sequence(self, sequence_id: str) -> tuple[ParentRequest, OutputSequence]:
        """A running sequence and the request it belongs to."""
        return self._sequences[sequence_id]

    def taken(self, request_id: str, n: int) -> str | None:
        """The id already in use (the request's own, or one of its sequences'), or None."""
        if request_id in self._parents:
            return request_id
        seq_ids = sequence_ids(request_id, n)
        return next((seq_id for seq_id in seq_ids if seq_id in self._sequences), None)

    def next_free_id(self, n: int) -> str:
        """A fresh request id for a request of n sequences: counting up, skipping ids taken."""
        while True:
            self._last_id += 1
            candidate = str(self._last_id)
            if self.taken(candidate, n) is None:
                return candidate

    def add(self, parent: ParentRequest) -> None:
        self._parents[parent.request_id] = parent
        for sequence in parent.sequences:
            self._sequences[sequence.request.request_id] = (parent, sequence)

    def remove(self, request_id: str) -> ParentRequest | None:
        """Forget the request and its sequences; None when it is not here."""
        parent = self._parents.pop(request_id, None)
        if parent is not None:
            for sequence in parent.sequences:
                self._sequences.pop(sequence.request.request_id, None)
        return parent
