"""The engine's plain records: what one step ran, the prefix cache's counters, and the
engine's counters at one moment (what metrics, status pages and benchmarks read)."""

from __future__ import annotations

from dataclasses import dataclass

from forklift.spec_decode.stats import SpecDecodeStats


@dataclass(frozen=True)
class StepRecord:
    """What one engine step ran: which requests, how many tokens, how long it took."""

    index: int
    start_time: float
    duration_s: float
    request_ids: tuple[str, ...]
    num_batched_tokens: int
    num_sampled: int
    num_preempted: int
    # Prompt tokens computed (the rest of num_batched_tokens recompute or decode outputs).
    num_prompt_tokens: int = 0


@dataclass(frozen=True)
class PrefixCacheStats:
    """Prompt tokens looked up in the prefix cache and found there, since the start."""

    enabled: bool
    query_tokens: int
    hit_tokens: int
    cached_blocks: int
    evictions: int

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


@dataclass(frozen=True)
class EngineStats:
    """The engine's counters at one moment: what metrics, status pages and benchmarks read."""

    num_running: int
    num_waiting: int
    # Preemptions since the start (each one frees a request's blocks to recompute it later).
    num_preemptions: int
    kv_usage: float  # fraction of usable KV blocks held by requests
    num_free_blocks: int
    num_usable_blocks: int
    prefix_cache: PrefixCacheStats
    # (reserved token slots, computed tokens) of every running request.
    running_slots: tuple[tuple[int, int], ...] = ()
    # Speculative decoding's counters; None when it is off.
    spec_decode: SpecDecodeStats | None = None
