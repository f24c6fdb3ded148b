"""What the engine hands back to callers, shaped like vLLM's `RequestOutput`."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int
    decoded_token: str | None = None


# One dict per generated token: token id -> Logprob (the sampled token plus the top N).
SampleLogprobs = list[dict[int, Logprob]]
# One per prompt token, None for the first (vLLM's shape): the token plus the top N.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass(frozen=True)
class PrefillChunk:
    """One step that computed some of a request's prompt (a cache hit computes none)."""

    start_time: float
    end_time: float
    prompt_tokens: int  # this request's prompt tokens in the step
    step_tokens: int  # every row of the step, decodes and other prompts included


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (time.time()) of one request's life, the timeline of its first
    token: arrival (the server got it), queued (the engine took it), first scheduled, each
    prefill chunk, first token (sampled), first sent (the server's event loop had it)."""

    arrival_time: float
    queued_time: float | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    first_sent_time: float | None = None
    finished_time: float | None = None
    prefill_chunks: list[PrefillChunk] = field(default_factory=list)
    # Engine steps that ran while the request waited to be scheduled.
    steps_waited: int = 0

    def first_token_phases(self) -> dict[str, float] | None:
        """Seconds spent in each phase before the first token reached the server's event
        loop (None until it has): tokenizing and queueing to the engine, waiting for a
        step, prefill, the step that samples, delivery. The phases add up to the TTFT."""
        stamps = (self.queued_time, self.first_scheduled_time, self.first_token_time)
        if any(t is None for t in stamps) or self.first_sent_time is None:
            return None
        queued, scheduled, first_token = stamps
        assert queued is not None and scheduled is not None and first_token is not None
        # A preempted request computes its prompt again after its first token: not counted.
        before = [c for c in self.prefill_chunks if c.start_time <= first_token]
        # The first chunk starts at the first schedule, so the last one starts no earlier.
        last_start = before[-1].start_time if before else scheduled
        return {
            "to_engine_s": queued - self.arrival_time,
            "waiting_s": scheduled - queued,
            "prefill_s": last_start - scheduled,
            "last_step_s": first_token - last_start,
            "delivery_s": self.first_sent_time - first_token,
            "ttft_s": self.first_sent_time - self.arrival_time,
        }


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def sampled_logprobs(self) -> list[float] | None:
        """The logprob of each sampled token (needs `logprobs` >= 0), for RL losses."""
        if self.logprobs is None:
            return None
        return [step[t].logprob for step, t in zip(self.logprobs, self.token_ids, strict=True)]


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    # The engine's weight version when this output was produced (see update_weights).
    weight_version: int = 0
    # SamplingParams.prompt_logprobs; complete once the prompt is computed (the first output).
    prompt_logprobs: PromptLogprobs | None = None
    extra: dict[str, object] = field(default_factory=dict)
