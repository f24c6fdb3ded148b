"""Counters of speculation since the start: what metrics, `/status` and benchmarks read."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    # Verifications (a sequence's step that carried drafts), drafts in them, drafts accepted.
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # Drafts accepted at each position (index 0: the first draft of a verification).
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        while len(self.accepted_per_position) < num_draft_tokens:
            self.accepted_per_position.append(0)
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verification yields on average: the accepted drafts plus the target's own."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def snapshot(self) -> SpecDecodeStats:
        return SpecDecodeStats(
            self.num_drafts,
            self.num_draft_tokens,
            self.num_accepted_tokens,
            list(self.accepted_per_position),
        )
