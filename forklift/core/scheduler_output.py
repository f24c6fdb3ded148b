"""What the scheduler hands the runner for one step, as plain data: no engine objects, so the
runner and sampler depend on nothing above them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from forklift.sampling_params import SamplingParams

if TYPE_CHECKING:
    from forklift.structured.grammar import GrammarMatcher


@dataclass(slots=True)
class SamplingRow:
    """What the sampler needs of one sequence that yields a token this step."""

    params: SamplingParams
    # Seed of this sequence's sampling noise.
    seed: int
    # Views of the sequence's tokens, read during the step and never changed by it.
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    eos_token_ids: frozenset[int] = frozenset()
    # Structured outputs: the sequence's place in its grammar (masks come from it).
    grammar: GrammarMatcher | None = None

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)


@dataclass(slots=True)
class ScheduledChunk:
    """One sequence's tokens computed this step: a prefill chunk, a decode or a recompute."""

    request_id: str
    token_ids: Sequence[int]
    # The position of the first of `token_ids` (tokens before it are in the KV cache).
    start: int
    # The sequence's KV blocks in order, covering `start + len(token_ids)` positions: a view
    # of the KV manager's table, valid for this step (read before the next schedule()).
    block_table: Sequence[int]
    # Prompt tokens among `token_ids` (the rest are outputs: decodes or their recompute).
    num_prompt_tokens: int = 0
    # Hybrid models: the sequence's state slot (0, the zero slot, for other models).
    state_slot: int = 0
    # Set when this chunk reaches the end of the sequence's tokens, so it yields a token.
    sampling: SamplingRow | None = None
    # Prompt logprobs (SamplingParams.prompt_logprobs): how many top tokens, and the prompt
    # token each of this chunk's first len(targets) positions predicts (position p: p + 1).
    prompt_logprobs: int | None = None
    prompt_logprob_targets: Sequence[int] = ()
    # Speculative decoding: the last this-many of `token_ids` are drafts, each position of
    # the chunk yields the target's token there, and the engine keeps them up to the first
    # draft the target disagrees with.
    num_draft_tokens: int = 0
    # Models whose layers fall into several KV groups: every group's table (the first is
    # `block_table`), views valid for this step as `block_table` is.
    group_tables: Sequence[Sequence[int]] = ()
    # The LoRA slot whose adapter this sequence runs with; -1: the base model.
    lora_slot: int = -1
    # Hybrid models verifying drafts: a spare state slot per draft, where the state after
    # each draft goes (the state after the chunk's first token goes to `state_slot`).
    draft_state_slots: Sequence[int] = ()
    # A row of such a chunk after its first: the slot it reads its state from (the row
    # before wrote it this step); -1: `state_slot` itself.
    state_read_slot: int = -1

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def samples(self) -> bool:
        return self.sampling is not None

    @property
    def scores_prompt(self) -> bool:
        return self.prompt_logprobs is not None and len(self.prompt_logprob_targets) > 0


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledChunk] = field(default_factory=list)
    # Ids of the sequences preempted this step (their blocks were freed).
    preempted: list[str] = field(default_factory=list)
    # (source, target) state slots the runner copies before this step's forward.
    state_copies: list[tuple[int, int]] = field(default_factory=list)
    # (source, target) KV blocks the runner copies before this step's forward: the partly
    # filled last prompt block of a sample of n > 1, copied from its leader's.
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # (slot, adapter id) the runner loads before this step's forward.
    lora_loads: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
