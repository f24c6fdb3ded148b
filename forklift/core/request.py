"""One sequence's state inside the engine: WAITING -> RUNNING <-> PREEMPTED -> FINISHED."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from forklift.core.draft_budget import AcceptanceRecord
from forklift.core.scheduler_output import SamplingRow
from forklift.sampling_params import SamplingParams

if TYPE_CHECKING:
    from forklift.structured.grammar import GrammarMatcher


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(eq=False)
class Request:
    """A single generated sequence (a prompt with `n > 1` becomes n of these).

    `num_computed_tokens` counts the tokens whose K/V are in the cache; the scheduler hands out
    tokens until it catches up with `all_token_ids`. That one counter covers chunked prefill,
    decode and recompute after preemption.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    # Seed of this sequence's sampling noise; drawn by the engine when the user gives none.
    seed: int
    # Output budget after capping by max_model_len.
    max_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = 0.0
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    # When it last joined the waiting queue: arrival, or its latest preemption.
    queued_time: float = 0.0
    # Extra prefix-cache key (weight version, cache salt): chains never cross it.
    cache_key: bytes = b""
    # The LoRA adapter this sequence runs with (its lora_int_id); 0: the base model.
    lora_id: int = 0
    # Prompt tokens found in the prefix cache at first admission.
    num_cached_tokens: int = 0
    # Parallel sampling: the first sequence of a group computes the prompt; the others wait
    # for it (`prefix_leader`) and then share its full prompt blocks instead of recomputing.
    prefix_leader: Request | None = None
    followers: list[Request] = field(default_factory=list)
    # Structured outputs: this sequence's place in its grammar. It has consumed every output
    # token, so recompute after preemption leaves it as it is.
    grammar: GrammarMatcher | None = None
    # Speculative decoding: guesses at the tokens after `all_token_ids`, checked in the next
    # step that decodes this sequence (and dropped if it does not).
    draft_token_ids: list[int] = field(default_factory=list)
    # ... and how often this sequence's drafts were accepted lately (sizes its next drafts).
    acceptance: AcceptanceRecord = field(default_factory=AcceptanceRecord)

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)
        if not self.queued_time:
            self.queued_time = self.arrival_time

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def sampling_row(self) -> SamplingRow:
        return SamplingRow(
            self.sampling_params,
            self.seed,
            self.prompt_token_ids,
            self.output_token_ids,
            self.eos_token_ids,
            self.grammar,
        )

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def check_stop_token(self) -> FinishReason | None:
        """Finish on EOS / stop_token_ids / max_tokens after the newest token was appended."""
        params = self.sampling_params
        last = self.output_token_ids[-1]
        if self.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and last in self.eos_token_ids:
                return FinishReason.STOP
            if last in params.stop_token_ids:
                self.stop_reason = last
                return FinishReason.STOP
        if self.num_output_tokens >= self.max_tokens:
            return FinishReason.LENGTH
        return None
