"""What proposers offer the engine: lookups that read token ids one sequence at a time, and
batch proposers (a draft model) that run for every decoding sequence at once."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from forklift.core.kv_cache_manager import KVCacheManager
from forklift.speculative_config import SpeculativeConfig


@dataclass(frozen=True)
class DraftQuery:
    """One decoding sequence asking for up to `max_tokens` drafts after its newest token."""

    request_id: str
    # Prompt and output so far; the newest token is not in the target's KV cache yet.
    token_ids: Sequence[int]
    num_computed_tokens: int
    # Bumped by each preemption: the sequence's blocks (and a draft's K/V in them) are new.
    num_preemptions: int
    max_tokens: int


class Proposer(Protocol):
    """Guesses a sequence's next tokens from what it has seen. These proposers only read
    token ids, so they run between steps without touching the model."""

    def propose(self, request_id: str, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        """Up to `max_tokens` guesses to follow `token_ids` (prompt and output so far), which
        only grow between calls for one request."""
        ...

    def finish(self, request_id: str, output_token_ids: Sequence[int]) -> None:
        """The request ended (finished or aborted): drop its state, keep what it taught."""
        ...


@runtime_checkable
class BatchProposer(Protocol):
    """Proposes for every decoding sequence in one call (a model's forward serves them all)."""

    def propose_batch(self, queries: Sequence[DraftQuery]) -> list[list[int]]: ...

    def finish(self, request_id: str, output_token_ids: Sequence[int]) -> None: ...


def propose_all(
    proposer: Proposer | BatchProposer, queries: Sequence[DraftQuery]
) -> list[list[int]]:
    """Each query's drafts, from a batch proposer at once or a lookup one by one."""
    if isinstance(proposer, BatchProposer):
        return proposer.propose_batch(queries)
    return [proposer.propose(q.request_id, q.token_ids, q.max_tokens) for q in queries]


def reserve_guess_slots(kv_manager: KVCacheManager, query: DraftQuery, guesses: int) -> bool:
    """Blocks for the positions a drafter writes while guessing `guesses` tokens: the newest
    token's and every guess's but the last (fed back to guess the next); False if none are
    left."""
    return kv_manager.allocate_slots(query.request_id, len(query.token_ids) + guesses - 1)


def release_unverified_slots(kv_manager: KVCacheManager, query: DraftQuery, drafts: int) -> None:
    """Give back what the drafter reserved beyond the newest token and its `drafts`, the
    positions verification computes."""
    kv_manager.release_tail(query.request_id, len(query.token_ids) + drafts)


def make_proposer(config: SpeculativeConfig) -> Proposer:
    """The lookup proposers; a draft model is built with the engine's runner
    (model_drafters/draft_model.py)."""
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
