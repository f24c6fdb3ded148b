"""Fan-in of several request streams, SSE framing, and abort when the client leaves."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from forklift.outputs import RequestOutput

_DONE = object()


async def merge_streams(
    streams: list[AsyncIterator[RequestOutput]],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Yield (stream index, output) as outputs arrive from any stream.

    Closing this generator cancels the readers, which closes each stream and so aborts its
    request in the engine.
    """
    queue: asyncio.Queue[Any] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for output in stream:
                await queue.put((index, output))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            await queue.put(exc)
        finally:
            await queue.put(_DONE)

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            item = await queue.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


async def collect_unless_disconnected(
    outputs: AsyncIterator[tuple[int, RequestOutput]],
    is_disconnected: Callable[[], Awaitable[bool]],
    poll_s: float = 0.5,
) -> dict[int, RequestOutput] | None:
    """Drain a merged stream to each request's final output; None if the client left."""
    final: dict[int, RequestOutput] = {}

    async def drain() -> None:
        async for index, output in outputs:
            final[index] = output

    task = asyncio.create_task(drain())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=poll_s)
            if not task.done() and await is_disconnected():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                return None
        task.result()
        return final
    finally:
        if not task.done():
            task.cancel()
        await outputs.aclose()  # type: ignore[attr-defined]


def sse(data: dict[str, Any] | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n"
