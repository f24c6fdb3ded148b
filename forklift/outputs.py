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


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (time.time()) of one request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


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
