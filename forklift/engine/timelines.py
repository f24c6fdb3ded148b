"""The first-token timelines of the last finished requests: where each request's time to
first token went (to the engine, waiting for a step, prefill, the sampling step, delivery
to the server's event loop), for `/status.json` and `forklift bench serve`."""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any

from forklift.outputs import RequestMetrics, RequestOutput

PHASES = ("to_engine_s", "waiting_s", "prefill_s", "last_step_s", "delivery_s", "ttft_s")


@dataclass(frozen=True)
class FinishedTimeline:
    request_id: str
    prompt_tokens: int
    cached_tokens: int
    metrics: RequestMetrics
    phases: dict[str, float]  # RequestMetrics.first_token_phases, final once it finished

    def to_json(self) -> dict[str, Any]:
        m = self.metrics
        return {
            "request_id": self.request_id,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "steps_waited": m.steps_waited,
            "prefill_chunks": [
                {
                    "start_ms": (c.start_time - m.arrival_time) * 1e3,
                    "ms": (c.end_time - c.start_time) * 1e3,
                    "prompt_tokens": c.prompt_tokens,
                    "step_tokens": c.step_tokens,
                }
                for c in m.prefill_chunks
            ],
            **{name.removesuffix("_s") + "_ms": value * 1e3 for name, value in self.phases.items()},
        }


class FirstTokenTimelines:
    """A bounded log, appended on the server's event loop and read on the engine thread
    (a deque's append and copy are atomic)."""

    def __init__(self, capacity: int = 256) -> None:
        self._finished: deque[FinishedTimeline] = deque(maxlen=capacity)

    def record(self, output: RequestOutput) -> None:
        metrics = output.metrics
        phases = metrics.first_token_phases() if metrics is not None else None
        if metrics is None or phases is None:
            return  # aborted before its first token: no timeline to show
        self._finished.append(
            FinishedTimeline(
                output.request_id,
                len(output.prompt_token_ids),
                output.num_cached_tokens or 0,
                metrics,
                phases,
            )
        )

    def since(self, arrival_time: float) -> list[dict[str, Any]]:
        """Every kept timeline of a request that arrived at or after `arrival_time`."""
        return [
            {"arrival_time": t.metrics.arrival_time, **t.to_json()}
            for t in list(self._finished)
            if t.metrics.arrival_time >= arrival_time
        ]

    def to_json(self, recent: int = 16) -> dict[str, Any]:
        """The medians of each phase over the log (ms), and the last `recent` timelines."""
        timelines = list(self._finished)
        median = {
            name.removesuffix("_s") + "_ms": statistics.median(t.phases[name] for t in timelines)
            * 1e3
            for name in PHASES
            if timelines
        }
        return {
            "count": len(timelines),
            "median": median,
            "recent": [t.to_json() for t in timelines[-recent:]],
        }
