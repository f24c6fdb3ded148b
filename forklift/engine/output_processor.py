"""Sampled ids -> text, logprobs, stop strings and `RequestOutput`s.

A user request with `n > 1` fans out into n engine sequences; `ParentRequest` gathers them
back into one `RequestOutput` whose `outputs[i]` is sequence i.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from forklift.core.request import FinishReason, Request
from forklift.engine.detokenizer import IncrementalDetokenizer
from forklift.outputs import (
    CompletionOutput,
    Logprob,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
)
from forklift.runner.prompt_scores import PromptScores
from forklift.tokenizer import Tokenizer


@dataclass(eq=False)
class OutputSequence:
    """One engine sequence plus what the caller sees of it."""

    index: int
    request: Request
    detokenizer: IncrementalDetokenizer | None
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None

    def completion(self) -> CompletionOutput:
        request = self.request
        finished = request.is_finished
        if self.detokenizer is None:
            text = ""
        else:
            text = self.detokenizer.visible_text(finished)
        return CompletionOutput(
            index=self.index,
            text=text,
            token_ids=list(request.output_token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            finish_reason=request.finish_reason.value if request.finish_reason else None,
            stop_reason=request.stop_reason,
        )


@dataclass(eq=False)
class ParentRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    metrics: RequestMetrics
    sequences: list[OutputSequence] = field(default_factory=list)
    # SamplingParams.prompt_logprobs: None for the first prompt token, then one entry per
    # prompt token as the prefill reaches it.
    prompt_logprobs: PromptLogprobs | None = None
    # The engine's step count when the request was queued (its timeline's steps_waited).
    queued_at_step: int = 0

    @property
    def finished(self) -> bool:
        return all(s.request.is_finished for s in self.sequences)

    def to_output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[s.completion() for s in self.sequences],
            finished=self.finished,
            metrics=self.metrics,
            num_cached_tokens=self.sequences[0].request.num_cached_tokens,
            prompt_logprobs=list(self.prompt_logprobs) if self.prompt_logprobs else None,
        )


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer

    def new_detokenizer(self, request: Request) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            return None
        params = request.sampling_params
        return IncrementalDetokenizer(
            self.tokenizer,
            skip_special_tokens=params.skip_special_tokens,
            stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
        )

    def process_token(
        self,
        sequence: OutputSequence,
        token_id: int,
        logprob: float | None,
        rank: int | None,
        top: list[tuple[int, float]] | None,
    ) -> bool:
        """Record one sampled token (already appended to the request). Returns True when a
        stop string ends the sequence."""
        request = sequence.request
        if logprob is not None:
            self._record_logprobs(sequence, token_id, logprob, rank or 1, top or [])
        detok = sequence.detokenizer
        if detok is None:
            return False
        stopped_on_token = request.is_finished and request.finish_reason == FinishReason.STOP
        hit_stop = False
        if not stopped_on_token:
            # Like EOS, stop strings only end a sequence once min_tokens are out.
            may_stop = request.num_output_tokens >= request.sampling_params.min_tokens
            hit_stop = detok.update([token_id], check_stop=may_stop)
        if request.is_finished or hit_stop:
            detok.finalize()
        return hit_stop

    def _record_logprobs(
        self,
        sequence: OutputSequence,
        token_id: int,
        logprob: float,
        rank: int,
        top: list[tuple[int, float]],
    ) -> None:
        entry = {token_id: Logprob(logprob, rank, self._token_text(token_id))}
        for position, (tid, value) in enumerate(top, start=1):
            if tid not in entry:
                entry[tid] = Logprob(value, position, self._token_text(tid))
        if sequence.logprobs is None:
            sequence.logprobs = []
        sequence.logprobs.append(entry)
        sequence.cumulative_logprob = (sequence.cumulative_logprob or 0.0) + logprob

    def record_prompt_logprobs(
        self, parent: ParentRequest, first_token: int, scores: PromptScores, top: int
    ) -> None:
        """Scores of prompt tokens first_token, first_token + 1, ...; a token already scored
        (a recomputed chunk, another sample's copy of the prompt) is not added twice. The
        step scored the most top tokens any request asked for: this one keeps its `top`."""
        entries = parent.prompt_logprobs
        if entries is None:
            return
        prompt = parent.prompt_token_ids
        for row, logprob in enumerate(scores.logprobs):
            index = first_token + row
            if index != len(entries):
                continue
            token = prompt[index]
            entry = {token: Logprob(logprob, scores.ranks[row], self._token_text(token))}
            best = zip(scores.top_ids[row][:top], scores.top_logprobs[row][:top], strict=True)
            for rank, (tid, value) in enumerate(best, start=1):
                if tid not in entry:
                    entry[tid] = Logprob(value, rank, self._token_text(tid))
            entries.append(entry)

    def _token_text(self, token_id: int) -> str | None:
        return self.tokenizer.token_text(token_id) if self.tokenizer is not None else None


def mark_first_token(metrics: RequestMetrics) -> None:
    if metrics.first_token_time is None:
        metrics.first_token_time = time.time()
