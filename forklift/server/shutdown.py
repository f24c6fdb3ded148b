"""Graceful shutdown of `forklift serve` on SIGTERM / SIGINT.

The first signal stops new requests (503) and lets the running ones finish for up to
`timeout_s`; then whatever is left is aborted (finish reason "abort"), every block is
freed, and the server exits 0. A second signal exits at once.
"""

from __future__ import annotations

import logging
import os
import time
from types import FrameType
from typing import Protocol, TextIO

import uvicorn

from forklift.server.announce import AnnouncingServer

logger = logging.getLogger("forklift")

# How long uvicorn may take to finish writing responses once the engine is idle.
_CLOSE_CONNECTIONS_S = 5.0


class Drainable(Protocol):
    """What serves the requests: an `AsyncEngine`, or the data-parallel front end."""

    def stop_accepting(self) -> None: ...

    def is_idle(self) -> bool: ...

    def abort_all(self) -> int: ...

    def failure(self) -> BaseException | None:
        """What stopped it for good (a dead engine), if anything did."""
        ...


class DrainingServer(AnnouncingServer):
    def __init__(
        self,
        config: uvicorn.Config,
        line: str,
        out: TextIO,
        target: Drainable,
        timeout_s: float,
    ) -> None:
        config.timeout_graceful_shutdown = config.timeout_graceful_shutdown or _CLOSE_CONNECTIONS_S
        super().__init__(config, line, out)
        self._target = target
        self._timeout_s = timeout_s
        self._deadline: float | None = None
        self._aborted = False
        # Set when the target died: the server then exits non-zero instead of serving 503s.
        self.failed = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not uvicorn's: it would stop listening at once (refused connections, not 503s)
        # and re-raise the signal after shutting down (a non-zero exit).
        if self._deadline is not None:
            logger.warning("forklift: second signal, exiting now")
            os._exit(128 + sig)
        logger.warning(
            "forklift: shutting down; new requests get 503, running ones have %.0f s to finish"
            " (signal again to exit now)",
            self._timeout_s,
        )
        self._deadline = time.monotonic() + self._timeout_s
        self._target.stop_accepting()

    async def on_tick(self, counter: int) -> bool:
        failure = self._target.failure()
        if failure is not None:
            if not self.failed:
                logger.error("forklift: the engine stopped (%s); exiting", failure)
            self.failed = True
            self._target.stop_accepting()
            return True
        if self._deadline is not None:
            if self._target.is_idle():
                return True
            if time.monotonic() >= self._deadline and not self._aborted:
                self._aborted = True
                count = self._target.abort_all()
                logger.warning("forklift: shutdown timeout, aborted %d request(s)", count)
        return await super().on_tick(counter)
