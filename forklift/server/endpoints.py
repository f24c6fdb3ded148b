"""The generation endpoints by path: body type and handler, one table for the HTTP routes
and for batch jobs, so a batch line is validated and run exactly as a POST would be."""

from __future__ import annotations

import json
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from fastapi.responses import Response
from pydantic import ValidationError

from forklift.server.chat import create_chat_completion
from forklift.server.completions import create_completion
from forklift.server.errors import APIError, invalid_body
from forklift.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from forklift.server.serving import ServerContext

IsDisconnected = Callable[[], Awaitable[bool]]
Handler = Callable[[ServerContext, Any, IsDisconnected], Awaitable[Response | None]]


@dataclass(frozen=True)
class GenerationEndpoint:
    body_type: type[SamplingFields]
    handle: Handler


GENERATION_ENDPOINTS: Mapping[str, GenerationEndpoint] = MappingProxyType(
    {
        "/v1/chat/completions": GenerationEndpoint(ChatCompletionRequest, create_chat_completion),
        "/v1/completions": GenerationEndpoint(CompletionRequest, create_completion),
    }
)


@dataclass(frozen=True)
class EndpointAnswer:
    """What the server answers one request: the HTTP status and the JSON body."""

    status_code: int
    request_id: str
    body: dict[str, Any]


async def _never_disconnected() -> bool:
    return False


async def answer(ctx: ServerContext, url: str, body: Any) -> EndpointAnswer:
    """The whole (not streamed) answer to a POST of `body` to `url`; bad requests are
    answered with their error, as over HTTP. Engine failures (overloaded, draining, dead)
    are raised: they say nothing about the request."""
    try:
        endpoint = GENERATION_ENDPOINTS.get(url)
        if endpoint is None:
            known = ", ".join(GENERATION_ENDPOINTS)
            raise APIError(400, f"url {url!r} is not one of {known}", "url")
        if not isinstance(body, dict):
            raise APIError(400, "body must be a JSON object", "body")
        try:
            request = endpoint.body_type.model_validate(body)
        except ValidationError as exc:
            raise invalid_body(exc.errors()) from exc
        if request.stream:
            raise APIError(400, "stream is not supported here: answers are written whole", "stream")
        response = await endpoint.handle(ctx, request, _never_disconnected)
    except APIError as exc:
        return EndpointAnswer(exc.status, _request_id(), exc.body())
    assert response is not None  # only a client that left gets None
    payload = json.loads(bytes(response.body))
    return EndpointAnswer(response.status_code, payload.get("id") or _request_id(), payload)


def _request_id() -> str:
    return f"req-{uuid.uuid4().hex}"
