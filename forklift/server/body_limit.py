"""An ASGI middleware that bounds request bodies, by Content-Length and by bytes received.

A body over the limit is a 413 in OpenAI's error shape. Counting what arrives (not only the
header) also bounds chunked uploads, and nothing is buffered here, so a route that streams
its body (POST /v1/weights) never holds more than one chunk of it in memory.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from forklift.server.errors import error_response

TOO_LARGE = 413


def too_large_message(limit: int) -> str:
    return f"the request body is larger than the limit of {limit} bytes"


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, limit_for: Callable[[str], int]) -> None:
        self.app = app
        self.limit_for = limit_for

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit_for(scope["path"])
        declared = _content_length(scope)
        if declared == "invalid":
            await error_response(400, "invalid Content-Length header")(scope, receive, send)
            return
        if isinstance(declared, int) and declared > limit:
            await error_response(TOO_LARGE, too_large_message(limit))(scope, receive, send)
            return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    # FastAPI re-raises an HTTPException from body reading; the app's
                    # handler turns it into the 413 in OpenAI's shape.
                    raise HTTPException(TOO_LARGE, too_large_message(limit))
            return message

        await self.app(scope, counting_receive, send)


def _content_length(scope: Scope) -> Any:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            text = value.decode("latin-1").strip()
            return int(text) if text.isdigit() else "invalid"
    return None
