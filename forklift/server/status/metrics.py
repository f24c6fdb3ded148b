"""Prometheus metrics of one server, in a registry of its own."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from forklift.engine.engine import LLMEngine
from forklift.outputs import RequestOutput
from forklift.server.status.history import StatusHistory
from forklift.spec_decode.stats import SpecDecodeStats

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0,
)  # fmt: skip


@dataclass
class _Progress:
    tokens: int = 0
    last_token_time: float | None = None


@dataclass
class ServerMetrics:
    """Updated from the engine thread after every step; rendered on GET /metrics."""

    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    _progress: dict[str, _Progress] = field(default_factory=dict)
    _seen_preemptions: int = 0
    _seen_prefix_queries: int = 0
    _seen_prefix_hits: int = 0
    _seen_step: int = 0
    _seen_spec: SpecDecodeStats = field(default_factory=SpecDecodeStats)
    # The status page's charts: the last minutes in buckets.
    history: StatusHistory = field(default_factory=StatusHistory)

    def __post_init__(self) -> None:
        r = self.registry
        self.running = Gauge("forklift:num_requests_running", "Requests in the batch", registry=r)
        self.waiting = Gauge("forklift:num_requests_waiting", "Requests queued", registry=r)
        self.kv_usage = Gauge(
            "forklift:kv_cache_usage_perc", "KV-cache blocks in use (0-1)", registry=r
        )
        self.prompt_tokens = Counter(
            "forklift:prompt_tokens", "Prompt tokens of finished requests", registry=r
        )
        self.generation_tokens = Counter(
            "forklift:generation_tokens", "Generated tokens", registry=r
        )
        self.preemptions = Counter("forklift:num_preemptions", "Preemptions", registry=r)
        self.prefix_queries = Counter(
            "forklift:prefix_cache_queries", "Tokens looked up in the prefix cache", registry=r
        )
        self.prefix_hits = Counter(
            "forklift:prefix_cache_hits", "Tokens found in the prefix cache", registry=r
        )
        # Speculative decoding, with vLLM's names (they stay at 0 while it is off).
        self.spec_drafts = Counter(
            "forklift:spec_decode_num_drafts", "Verifications of drafts", registry=r
        )
        self.spec_draft_tokens = Counter(
            "forklift:spec_decode_num_draft_tokens", "Draft tokens verified", registry=r
        )
        self.spec_accepted_tokens = Counter(
            "forklift:spec_decode_num_accepted_tokens", "Draft tokens accepted", registry=r
        )
        self.spec_accepted_per_position = Counter(
            "forklift:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the draft",
            ["position"],
            registry=r,
        )
        self.finished = Counter(
            "forklift:request_success",
            "Finished requests by reason",
            ["finished_reason"],
            registry=r,
        )

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, buckets=_LATENCY_BUCKETS, registry=r)

        self.ttft = histogram("forklift:time_to_first_token_seconds", "Time to first token")
        self.itl = histogram("forklift:inter_token_latency_seconds", "Time between tokens")
        self.e2e = histogram("forklift:e2e_request_latency_seconds", "Arrival to finish")
        self.queue_time = histogram("forklift:request_queue_time_seconds", "Arrival to first step")

    def observe_step(self, engine: LLMEngine, outputs: list[RequestOutput]) -> None:
        stats = engine.stats()
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_usage)
        new_preemptions = stats.num_preemptions - self._seen_preemptions
        if new_preemptions:
            self.preemptions.inc(new_preemptions)
            self._seen_preemptions = stats.num_preemptions
        if stats.spec_decode is not None:
            self._observe_spec(stats.spec_decode)
        prefix = stats.prefix_cache
        new_queries = prefix.query_tokens - self._seen_prefix_queries
        new_hits = prefix.hit_tokens - self._seen_prefix_hits
        self.prefix_queries.inc(new_queries)
        self.prefix_hits.inc(new_hits)
        self._seen_prefix_queries, self._seen_prefix_hits = prefix.query_tokens, prefix.hit_tokens
        now = time.time()
        # Aborts call this too, after no new step: count each step's tokens once.
        step = engine.step_log[-1] if engine.step_log else None
        if step is not None and step.index == self._seen_step:
            step = None
        self.history.record_step(
            now,
            step.num_prompt_tokens if step else 0,
            step.num_sampled if step else 0,
            stats.kv_usage,
            stats.num_running,
            stats.num_waiting,
            new_queries,
            new_hits,
        )
        if step is not None:
            self._seen_step = step.index
        for output in outputs:
            self._observe_output(output, now)

    def _observe_spec(self, spec: SpecDecodeStats) -> None:
        seen = self._seen_spec
        self.spec_drafts.inc(spec.num_drafts - seen.num_drafts)
        self.spec_draft_tokens.inc(spec.num_draft_tokens - seen.num_draft_tokens)
        self.spec_accepted_tokens.inc(spec.num_accepted_tokens - seen.num_accepted_tokens)
        before = seen.accepted_per_position
        for position, count in enumerate(spec.accepted_per_position):
            new = count - (before[position] if position < len(before) else 0)
            if new:
                self.spec_accepted_per_position.labels(position=str(position)).inc(new)
        self._seen_spec = spec

    def _observe_output(self, output: RequestOutput, now: float) -> None:
        progress = self._progress.setdefault(output.request_id, _Progress())
        tokens = sum(len(c.token_ids) for c in output.outputs)
        new = tokens - progress.tokens
        if new > 0:
            self.generation_tokens.inc(new)
            if progress.last_token_time is None:
                if output.metrics is not None:
                    ttft = now - output.metrics.arrival_time
                    self.ttft.observe(ttft)
                    self.history.record_ttft(now, ttft)
            else:
                itl = (now - progress.last_token_time) / new
                self.itl.observe(itl)
                self.history.record_itl(now, itl)
            progress.tokens, progress.last_token_time = tokens, now
        if output.finished:
            self.observe_finished(output, now)

    def observe_finished(self, output: RequestOutput, now: float | None = None) -> None:
        now = time.time() if now is None else now
        self._progress.pop(output.request_id, None)
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        for completion in output.outputs:
            self.finished.labels(finished_reason=completion.finish_reason or "abort").inc()
        metrics = output.metrics
        if metrics is not None:
            self.e2e.observe(now - metrics.arrival_time)
            if metrics.first_scheduled_time is not None:
                self.queue_time.observe(metrics.first_scheduled_time - metrics.arrival_time)

    def render(self) -> bytes:
        return generate_latest(self.registry)
