"""What every proposer offers the engine, and the one that builds them from a config."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from forklift.spec_decode.config import SpeculativeConfig


class Proposer(Protocol):
    """Guesses a sequence's next tokens from what it has seen. Proposers only read token ids,
    so they run between steps without touching the model."""

    def propose(self, request_id: str, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        """Up to `max_tokens` guesses to follow `token_ids` (prompt and output so far), which
        only grow between calls for one request."""
        ...

    def finish(self, request_id: str, output_token_ids: Sequence[int]) -> None:
        """The request ended (finished or aborted): drop its state, keep what it taught."""
        ...


def make_proposer(config: SpeculativeConfig) -> Proposer:
    if config.method == "ngram":
        from forklift.spec_decode.ngram import NgramProposer

        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    from forklift.spec_decode.suffix import SuffixProposer

    return SuffixProposer(
        config.suffix_decoding_max_tree_depth,
        config.suffix_decoding_max_cached_requests,
        config.suffix_decoding_max_spec_factor,
        config.suffix_decoding_min_token_prob,
    )


def accepted_prefix(drafts: Sequence[int], sampled: Sequence[int]) -> int:
    """How many drafts the target confirmed: draft i stands when the target's own choice at
    position i (made knowing drafts before it) is that token. `sampled` holds one choice per
    position, drafts included, so the result is at most len(sampled) - 1."""
    accepted = 0
    while accepted < len(drafts) and accepted < len(sampled) - 1:
        if sampled[accepted] != drafts[accepted]:
            break
        accepted += 1
    return accepted
