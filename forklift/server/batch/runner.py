"""Runs batch lines through the engine together (continuous batching): up to `window`
requests in flight, each record handed on the moment its request finishes."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from forklift.engine.async_engine import EngineDeadError, EngineDrainingError, EngineOverloadedError
from forklift.server.batch.records import BadLine, BatchLine, BatchRequest, answer_record
from forklift.server.batch.records import bad_line_record as record_of_bad_line
from forklift.server.endpoints import EndpointAnswer, answer
from forklift.server.errors import error_body
from forklift.server.serving import ServerContext

logger = logging.getLogger("forklift")

RecordSink = Callable[[dict[str, Any]], None]

# A server's waiting queue may be full of other traffic: a batch request waits its turn.
_OVERLOADED_RETRY_S = 0.25


class BatchInterrupted(Exception):
    """A request was aborted (the server shutting down): its answer is not the answer, so it
    is not recorded and the run stops, to be resumed."""


async def run_lines(
    ctx: ServerContext, lines: Iterable[BatchLine], emit: RecordSink, window: int
) -> None:
    """Answer every line, emitting one record each (bad lines at once, in order).

    An engine that stops taking requests (draining, dead) ends the run with its error: the
    records emitted so far stand and the rest are left for a resumed run (an aborted request
    ends it the same way, with BatchInterrupted)."""
    if window < 1:
        raise ValueError(f"window must be at least 1, got {window}")
    slots = asyncio.Semaphore(window)
    tasks: set[asyncio.Task[None]] = set()
    stopped: list[BaseException] = []

    async def run_one(item: BatchRequest) -> None:
        try:
            answered = await _answer_when_queued(ctx, item)
            if _was_aborted(answered):
                raise BatchInterrupted(f"the request of line {item.line} was aborted")
            emit(answer_record(item.custom_id, answered))
        except (EngineDrainingError, EngineDeadError, BatchInterrupted) as exc:
            stopped.append(exc)
        finally:
            slots.release()

    try:
        for item in lines:
            if isinstance(item, BadLine):
                emit(record_of_bad_line(item))
                continue
            await slots.acquire()
            if stopped:
                break
            task = asyncio.create_task(run_one(item))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()  # a cancelled run: closing each stream aborts its request
        await asyncio.gather(*tasks, return_exceptions=True)
    if stopped:
        raise stopped[0]


async def _answer_when_queued(ctx: ServerContext, item: BatchRequest) -> EndpointAnswer:
    while True:
        try:
            return await answer(ctx, item.url, item.body)
        except EngineOverloadedError:
            await asyncio.sleep(_OVERLOADED_RETRY_S)
        except (EngineDrainingError, EngineDeadError):
            raise
        except Exception:  # a fault of this request alone, answered as the server would: 500
            logger.exception("batch line %d (custom_id %r) failed", item.line, item.custom_id)
            body = error_body(500, "internal error while answering this request")
            return EndpointAnswer(500, f"req-{uuid.uuid4().hex}", body)


def _was_aborted(answered: EndpointAnswer) -> bool:
    choices = answered.body.get("choices") or []
    return any(choice.get("finish_reason") == "abort" for choice in choices)
