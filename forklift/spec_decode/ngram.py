"""Prompt lookup: the sequence's newest n tokens, found earlier in its prompt or output,
propose what followed them there (the longest n that matches wins, its latest occurrence)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class _NgramIndex:
    """Where each n-gram of one sequence last ended; grows with the sequence."""

    min_n: int
    max_n: int
    last_end: dict[tuple[int, ...], int] = field(default_factory=dict)
    # Positions whose n-grams ending there are indexed: all but the newest token, so the
    # tail looked up never finds itself.
    num_indexed: int = 0

    def extend(self, token_ids: Sequence[int]) -> None:
        for end in range(self.num_indexed, len(token_ids) - 1):
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                self.last_end[tuple(token_ids[end - n + 1 : end + 1])] = end
        self.num_indexed = max(self.num_indexed, len(token_ids) - 1)

    def lookup(self, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        for n in range(min(self.max_n, len(token_ids)), self.min_n - 1, -1):
            end = self.last_end.get(tuple(token_ids[len(token_ids) - n :]))
            if end is not None:
                return list(token_ids[end + 1 : end + 1 + max_tokens])
        return []


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self._indexes: dict[str, _NgramIndex] = {}

    def propose(self, request_id: str, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        index = self._indexes.get(request_id)
        if index is None:
            index = self._indexes[request_id] = _NgramIndex(self.min_n, self.max_n)
        index.extend(token_ids)
        return index.lookup(token_ids, max_tokens) if max_tokens > 0 else []

    def finish(self, request_id: str, output_token_ids: Sequence[int]) -> None:
        self._indexes.pop(request_id, None)

    @property
    def num_tracked(self) -> int:
        return len(self._indexes)
