"""The last few minutes of a server in fixed time buckets, for the status page's charts.

Fed from the engine thread after every step (tokens, KV usage, prefix lookups) and for every
streamed token (TTFT, inter-token latency); read on the engine thread too, with the
snapshot, so no lock is needed.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

# A bucket keeps at most this many latency samples (the first ones: enough for percentiles).
_MAX_SAMPLES = 512


@dataclass
class _Bucket:
    index: int  # floor(time / interval)
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    kv_usage: float = 0.0
    running: int = 0
    waiting: int = 0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)


class StatusHistory:
    def __init__(self, interval_s: float = 2.0, span_s: float = 300.0) -> None:
        if interval_s <= 0 or span_s < interval_s:
            raise ValueError("interval_s must be positive and span_s at least one interval")
        self.interval_s = interval_s
        self.num_buckets = int(span_s // interval_s)
        self._buckets: deque[_Bucket] = deque()

    def record_step(
        self,
        now: float,
        prompt_tokens: int,
        generation_tokens: int,
        kv_usage: float,
        running: int,
        waiting: int,
        prefix_queries: int,
        prefix_hits: int,
    ) -> None:
        bucket = self._bucket(now)
        bucket.prompt_tokens += prompt_tokens
        bucket.generation_tokens += generation_tokens
        bucket.prefix_queries += prefix_queries
        bucket.prefix_hits += prefix_hits
        bucket.kv_usage, bucket.running, bucket.waiting = kv_usage, running, waiting

    def record_ttft(self, now: float, seconds: float) -> None:
        samples = self._bucket(now).ttft
        if len(samples) < _MAX_SAMPLES:
            samples.append(seconds)

    def record_itl(self, now: float, seconds: float) -> None:
        samples = self._bucket(now).itl
        if len(samples) < _MAX_SAMPLES:
            samples.append(seconds)

    def to_json(self, now: float) -> dict[str, Any]:
        """Oldest first; `t` is seconds before `now`. Rates are per second; percentiles in
        milliseconds (null where a bucket saw none)."""
        last = math.floor(now / self.interval_s)
        by_index = {b.index: b for b in self._buckets}
        columns: dict[str, list[Any]] = {
            k: []
            for k in ("t", "prompt_tps", "generation_tps", "kv_usage", "running", "waiting",
                      "prefix_hit_rate", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms",
                      "itl_p99_ms")
        }  # fmt: skip
        first = last - self.num_buckets + 1
        # Idle buckets carry the newest state seen before them, even from before the window
        # (an engine paused for longer than the window still holds its cache and queues).
        older = [b for b in self._buckets if b.index < first]
        carried = older[-1] if older else _Bucket(-1)
        for index in range(first, last + 1):
            bucket = by_index.get(index)
            if bucket is None:  # idle: no tokens, the cache and queues as they were
                bucket = _Bucket(index, kv_usage=carried.kv_usage, running=carried.running,
                                 waiting=carried.waiting)  # fmt: skip
            carried = bucket
            columns["t"].append(round(now - index * self.interval_s, 3))
            columns["prompt_tps"].append(bucket.prompt_tokens / self.interval_s)
            columns["generation_tps"].append(bucket.generation_tokens / self.interval_s)
            columns["kv_usage"].append(bucket.kv_usage)
            columns["running"].append(bucket.running)
            columns["waiting"].append(bucket.waiting)
            columns["prefix_hit_rate"].append(
                bucket.prefix_hits / bucket.prefix_queries if bucket.prefix_queries else None
            )
            for name, samples in (("ttft", bucket.ttft), ("itl", bucket.itl)):
                columns[f"{name}_p50_ms"].append(_percentile_ms(samples, 50))
                columns[f"{name}_p99_ms"].append(_percentile_ms(samples, 99))
        return {"interval_s": self.interval_s, **columns}

    def _bucket(self, now: float) -> _Bucket:
        index = math.floor(now / self.interval_s)
        if self._buckets and self._buckets[-1].index == index:
            return self._buckets[-1]
        previous = self._buckets[-1] if self._buckets else None
        bucket = _Bucket(index)
        if previous is not None:  # until the next step says otherwise
            bucket.kv_usage, bucket.running, bucket.waiting = (
                previous.kv_usage, previous.running, previous.waiting
            )  # fmt: skip
        self._buckets.append(bucket)
        while self._buckets and self._buckets[0].index <= index - self.num_buckets:
            self._buckets.popleft()
        return bucket


def _percentile_ms(samples: list[float], q: float) -> float | None:
    if not samples:
        return None
    ordered = sorted(samples)
    rank = min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))
    return ordered[rank] * 1e3
