"""POST /v1/responses (OpenAI's Responses API, as vLLM serves it), and GET / DELETE of stored
responses.

A request is turned into the chat request it amounts to (instructions, earlier turns, input
items -> messages; tools, tool_choice and text.format -> chat's), so the chat template, the
tool-call parsers and the decoding constraints of /v1/chat/completions serve it unchanged.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse

from forklift.outputs import RequestOutput
from forklift.server.chat import chat_prompt_ids
from forklift.server.errors import APIError
from forklift.server.protocol import ChatCompletionRequest, ChatMessage
from forklift.server.responses.body import ResponsesRequest, refuse_unsupported
from forklift.server.responses.events import StreamedOutput
from forklift.server.responses.input import chat_messages, input_items
from forklift.server.responses.options import chat_response_format, tool_setup
from forklift.server.responses.output import (
    Outcome,
    ResponseFrame,
    output_items,
    response_usage,
)
from forklift.server.responses.store import ResponseStore, StoredResponse
from forklift.server.serving import Launch, ServerContext, launch, make_params
from forklift.server.streams import collect_unless_disconnected
from forklift.server.tools.assistant_message import ToolCallStreamer, final_message
from forklift.server.tools.parsers import ToolCallParser, make_parser
from forklift.server.tools.tool_choice import ToolRequest

# Chat's field names in errors from the shared machinery -> the Responses request's.
_FIELD_NAMES = (("response_format", "text.format"), ("max_tokens", "max_output_tokens"))


async def create_response(
    ctx: ServerContext,
    store: ResponseStore,
    body: ResponsesRequest,
    is_disconnected: Callable[[], Awaitable[bool]],
) -> JSONResponse | StreamingResponse | None:
    lora = ctx.check_model(body.model)
    refuse_unsupported(body)
    earlier: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        earlier = _stored(store, body.previous_response_id, "previous_response_id").items
    items = [*earlier, *input_items(body.input)]
    tools = tool_setup(body)
    messages = chat_messages(items, body.instructions)
    chat = ChatCompletionRequest(
        messages=[ChatMessage.model_validate(m) for m in messages],
        temperature=body.temperature,
        top_p=body.top_p,
        user=body.user,
        response_format=chat_response_format(body.text),
    )
    with _as_responses_fields():
        params = make_params(ctx, chat, body.max_output_tokens, None, tools)
        # Rendering the template and tokenizing run in a worker thread, off the event loop.
        prompt = await asyncio.to_thread(chat_prompt_ids, ctx, chat.messages, True, None, tools)
        run = await launch(ctx, "resp", [prompt], params, lora=lora)
    frame = ResponseFrame(
        "resp_" + run.response_id.removeprefix("resp-"), run.created, run.model, body
    )
    parser = make_parser(ctx.tool_call_parser, tools.names if tools else None)
    if body.stream:
        stream = _stream(store, frame, run, items, tools, parser)
        return StreamingResponse(stream, media_type="text/event-stream")
    finals = await collect_unless_disconnected(run.stream, is_disconnected)
    if finals is None:
        return None
    final = finals[0]
    completion = final.outputs[0]
    message, _ = final_message(completion.text, completion.finish_reason, tools, parser)
    outcome = Outcome.of(completion.finish_reason)
    output = output_items(message, outcome.last_item_status)
    response = frame.build(output, outcome, response_usage(run.prompt_ids, final))
    _keep(store, frame, response, items)
    return JSONResponse(response)


def retrieve_response(
    store: ResponseStore, response_id: str, query: Mapping[str, str]
) -> dict[str, Any]:
    for key, value in query.items():
        if not (key == "stream" and value.lower() == "false"):
            # Streaming a stored response again (stream, starting_after, include) is not kept.
            raise APIError(400, f"query parameter {key} is not supported by this server", key)
    return _stored(store, response_id, "response_id").response


def delete_response(store: ResponseStore, response_id: str) -> dict[str, Any]:
    if not store.delete(response_id):
        raise _not_found(response_id, "response_id")
    return {"id": response_id, "object": "response.deleted", "deleted": True}


async def _stream(
    store: ResponseStore,
    frame: ResponseFrame,
    run: Launch,
    items: list[dict[str, Any]],
    tools: ToolRequest | None,
    parser: ToolCallParser,
) -> AsyncIterator[str]:
    out = StreamedOutput()
    started = frame.build([], Outcome("in_progress"), None)
    yield out.event("response.created", response=started)
    yield out.event("response.in_progress", response=started)
    streamer = ToolCallStreamer(tools, parser) if tools is not None and tools.parses_calls else None
    final: RequestOutput | None = None
    sent = 0
    try:
        async for _, output in run.stream:
            if final is not None:
                continue
            if output.finished:
                final = output
            completion = output.outputs[0]
            if streamer is not None:
                finished = completion.finish_reason is not None
                deltas = streamer.deltas(completion.text, finished=finished)
            else:
                deltas = [{"content": completion.text[sent:]}]
                sent = len(completion.text)
            for delta in deltas:
                for line in out.feed(delta):
                    yield line
    finally:
        # A client that leaves closes this generator: closing the stream aborts the request.
        await run.stream.aclose()  # type: ignore[attr-defined]
    outcome = Outcome.of(final.outputs[0].finish_reason if final is not None else None)
    for line in out.finish(outcome.last_item_status):
        yield line
    response = frame.build(out.items, outcome, response_usage(run.prompt_ids, final))
    # Stored before the last event, so a follow-up sent on seeing it finds the response.
    _keep(store, frame, response, items)
    yield out.event(f"response.{outcome.status}", response=response)


def _keep(
    store: ResponseStore,
    frame: ResponseFrame,
    response: dict[str, Any],
    items: list[dict[str, Any]],
) -> None:
    if frame.body.stores:
        conversation = [*items, *input_items(response["output"], "output")]
        store.put(response["id"], StoredResponse(response, conversation))


def _stored(store: ResponseStore, response_id: str, param: str) -> StoredResponse:
    stored = store.get(response_id)
    if stored is None:
        raise _not_found(response_id, param)
    return stored


def _not_found(response_id: str, param: str) -> APIError:
    # Never stored (store: false), deleted, or evicted by newer responses: all look alike.
    return APIError(404, f"Response with id {response_id!r} not found.", param)


@contextmanager
def _as_responses_fields() -> Iterator[None]:
    """Errors of the chat machinery name chat's fields; a Responses client needs its own."""
    try:
        yield
    except APIError as exc:
        param = exc.param or ""
        if param.startswith("messages"):
            exc.param = "input"  # chat's message indexes are not the input's
        for chat_name, name in _FIELD_NAMES:
            if param == chat_name or param.startswith((chat_name + ".", chat_name + "[")):
                exc.param = name + param[len(chat_name) :]
                exc.message = exc.message.replace(chat_name, name)
        raise
