"""GET /status (a self-contained page) and GET /status.json (the snapshot it polls).

The snapshot is taken on the engine thread between two steps (also while the engine is
paused or asleep), at most once per `min_interval_s` however many pages poll; a step that
runs long makes the page show the previous snapshot, marked stale, instead of waiting.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from importlib.resources import files
from typing import Any

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, Response

from forklift.engine.async_engine import AsyncEngine, EngineDeadError
from forklift.engine.engine import LLMEngine
from forklift.engine.snapshot import STATE_NAMES, take_snapshot
from forklift.server.status.history import StatusHistory

STATUS_JSON_PATH = "/status.json"
# Every first-token timeline the server keeps, for benchmarks (`?since=` a Unix time).
FIRST_TOKEN_JSON_PATH = "/status/first_token.json"

logger = logging.getLogger("forklift")


def status_page() -> str:
    return files("forklift.server.status").joinpath("page.html").read_text(encoding="utf-8")


class SnapshotSource:
    """Rate-limited snapshots of one engine, shared by every poller.

    One engine call is in flight at a time; every poller awaits that same call, and one
    that waits longer than `timeout_s` gets the previous snapshot marked stale (the call
    itself carries on and serves the next pollers)."""

    def __init__(
        self,
        async_engine: AsyncEngine,
        history: StatusHistory,
        served_model_name: str,
        min_interval_s: float = 0.5,
        timeout_s: float = 2.0,
    ) -> None:
        self._engine = async_engine
        self._history = history
        self._name = served_model_name
        self._min_interval_s = min_interval_s
        self._timeout_s = timeout_s
        self._pending: asyncio.Future[dict[str, Any]] | None = None
        self._last: dict[str, Any] | None = None
        self._last_time = -math.inf
        self.num_taken = 0

    async def get(self) -> dict[str, Any]:
        if time.monotonic() - self._last_time < self._min_interval_s and self._last is not None:
            return self._last
        pending = self._pending
        if pending is None:
            pending = self._pending = asyncio.wrap_future(self._engine.call(self._read))
        try:
            data = await asyncio.wait_for(asyncio.shield(pending), self._timeout_s)
        except asyncio.TimeoutError:  # a long step: show what we had, say it is old
            return self._previous(stale=True)
        except EngineDeadError as exc:
            return {"snapshot": None, "history": None, "state": self._state(str(exc))}
        except Exception as exc:  # a snapshot bug must not take the page down: say it
            logger.exception("status snapshot failed")
            return self._previous(error=f"{type(exc).__name__}: {exc}")
        finally:
            if pending.done() and self._pending is pending:
                self._pending = None
        self._last, self._last_time = data, time.monotonic()
        return data

    def first_token_timelines(self, since: float) -> list[dict[str, Any]]:
        """The kept timelines of requests that arrived at or after `since` (Unix time)."""
        return self._engine.timelines.since(since)

    def _previous(self, stale: bool = False, error: str | None = None) -> dict[str, Any]:
        data = dict(self._last or {"snapshot": None, "history": None})
        data["state"] = {**data.get("state", {}), **self._state(), "stale": stale, "error": error}
        return data

    def _read(self, engine: LLMEngine) -> dict[str, Any]:
        """On the engine thread: the snapshot and the charts, read at the same moment."""
        self.num_taken += 1
        started = time.perf_counter()
        snapshot = take_snapshot(engine).to_json()
        now = time.time()
        return {
            "served_model_name": self._name,
            "snapshot": snapshot,
            "history": self._history.to_json(now),
            "first_token": self._engine.timelines.to_json(),
            "state": {**self._state(), "sleep_level": engine.sleep_level},
            "state_names": list(STATE_NAMES),
            "snapshot_ms": (time.perf_counter() - started) * 1e3,
        }

    def _state(self, dead: str | None = None) -> dict[str, Any]:
        failure = self._engine.failure()
        if dead is None and failure is not None:
            dead = str(failure)
        return {
            "paused": self._engine.paused,
            "accepting": self._engine.accepting,
            "pending": self._engine.num_pending(),
            "dead": dead,
            "stale": False,
            "error": None,
        }


def add_status_routes(app: FastAPI, source: SnapshotSource) -> None:
    @app.get("/status", response_class=HTMLResponse, include_in_schema=False)
    async def page() -> HTMLResponse:
        return HTMLResponse(status_page())

    @app.get(STATUS_JSON_PATH)
    async def snapshot() -> Response:
        # Plain json.dumps: FastAPI's encoder walks every value first, at several times the
        # cost, on the event loop.
        return Response(json.dumps(await source.get()), media_type="application/json")

    @app.get(FIRST_TOKEN_JSON_PATH)
    async def first_token_timelines(since: float = 0.0) -> Response:
        entries = source.first_token_timelines(since)
        return Response(json.dumps({"timelines": entries}), media_type="application/json")
