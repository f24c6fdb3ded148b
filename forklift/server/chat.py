"""POST /v1/chat/completions."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse

from forklift.outputs import CompletionOutput, RequestOutput
from forklift.server.errors import APIError
from forklift.server.protocol import ChatCompletionRequest, ChatMessage
from forklift.server.serving import (
    ChoiceProgress,
    Launch,
    ServerContext,
    json_logprob,
    launch,
    make_params,
    prompt_logprobs_json,
    token_id_fields,
    usage,
)
from forklift.server.streams import collect_unless_disconnected, sse
from forklift.server.tools.assistant_message import (
    ToolCallStreamer,
    final_message,
    stream_finish_reason,
)
from forklift.server.tools.parsers import make_parser
from forklift.server.tools.prompt import prepare_conversation
from forklift.server.tools.tool_choice import ToolRequest, tool_request
from forklift.tokenizer import CHAT_TEMPLATE_ARGUMENTS

# Variables the server passes to the chat template itself, and the names apply_chat_template
# takes as its own arguments (`tokenize`, `return_tensors`...); a request may set none of them.
_TEMPLATE_VARIABLES = frozenset(
    {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "unk_token",
     "pad_token"}
) | CHAT_TEMPLATE_ARGUMENTS  # fmt: skip


def chat_prompt_ids(
    ctx: ServerContext,
    messages: list[ChatMessage],
    add_generation_prompt: bool = True,
    template_kwargs: dict[str, Any] | None = None,
    tools: ToolRequest | None = None,
) -> list[int]:
    tokenizer = ctx.tokenizer
    if not messages:
        raise APIError(400, "messages must not be empty", "messages")
    template_kwargs = template_kwargs or {}
    reserved = sorted(set(template_kwargs) & _TEMPLATE_VARIABLES)
    if reserved:
        raise APIError(
            400,
            f"chat_template_kwargs may not set {', '.join(reserved)}: the server sets them",
            "chat_template_kwargs",
        )
    if tokenizer.chat_template is None:
        raise APIError(
            400,
            "this model has no chat template (a base model's file, say): use "
            "/v1/completions with a plain prompt",
            "messages",
        )
    conversation, template_tools = prepare_conversation(
        [m.model_dump(exclude_none=True) for m in messages],
        tools,
        tokenizer.chat_template,
        ctx.tool_call_parser,
    )
    try:
        return tokenizer.encode_chat(
            conversation,
            add_generation_prompt=add_generation_prompt,
            tools=template_tools,
            **template_kwargs,
        )
    except (ValueError, TypeError) as exc:  # TypeError: a template choking on request data
        raise APIError(400, f"the chat template failed on this request: {exc}", "messages") from exc


async def create_chat_completion(
    ctx: ServerContext,
    body: ChatCompletionRequest,
    is_disconnected: Callable[[], Awaitable[bool]],
) -> JSONResponse | StreamingResponse | None:
    lora = ctx.check_model(body.model)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs requires logprobs to be true", "top_logprobs")
    max_logprobs = ctx.async_engine.config.max_logprobs
    if body.top_logprobs is not None and body.top_logprobs > max_logprobs:
        raise APIError(
            400,
            f"top_logprobs is {body.top_logprobs}, more than the limit max_logprobs={max_logprobs}",
            "top_logprobs",
        )
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    max_tokens = body.max_completion_tokens
    if max_tokens is None:
        max_tokens = body.max_tokens
    tools = tool_request(body.tools, body.tool_choice, body.parallel_tool_calls)
    params = make_params(ctx, body, max_tokens, logprobs, tools)
    # Rendering the template and tokenizing run in a worker thread, off the event loop.
    prompt = await asyncio.to_thread(
        chat_prompt_ids,
        ctx,
        body.messages,
        body.add_generation_prompt,
        body.chat_template_kwargs,
        tools,
    )
    run = await launch(ctx, "chatcmpl", [prompt], params, body.cache_salt, lora)
    if body.stream:
        return StreamingResponse(_stream(ctx, body, run, tools), media_type="text/event-stream")
    finals = await collect_unless_disconnected(run.stream, is_disconnected)
    if finals is None:
        return None
    output = finals[0]
    parser = make_parser(ctx.tool_call_parser, tools.names if tools else None)
    choices = []
    for c in output.outputs:
        message, finish_reason = final_message(c.text, c.finish_reason, tools, parser)
        choices.append(
            {
                "index": c.index,
                "message": message,
                "logprobs": {"content": _logprob_content(c, 0, body.top_logprobs or 0)}
                if body.logprobs
                else None,
                "finish_reason": finish_reason,
                "stop_reason": c.stop_reason,
                **token_id_fields(body, c.token_ids),
            }
        )
    return JSONResponse(
        {
            "id": run.response_id,
            "object": "chat.completion",
            "created": run.created,
            "model": run.model,
            "choices": choices,
            "usage": usage(run.prompt_ids, [output]),
            "prompt_logprobs": prompt_logprobs_json(output, body.prompt_logprobs),
            **({"prompt_token_ids": run.prompt_ids[0]} if body.return_token_ids else {}),
        }
    )


async def _stream(
    ctx: ServerContext, body: ChatCompletionRequest, run: Launch, tools: ToolRequest | None
) -> AsyncIterator[str]:
    progress: dict[int, ChoiceProgress] = {}
    streamers: dict[int, ToolCallStreamer] = {}
    final: RequestOutput | None = None
    parser = make_parser(ctx.tool_call_parser, tools.names if tools else None)

    def chunk(choice: dict[str, Any], prompt_ids: list[int] | None = None) -> str:
        return sse(
            {
                "id": run.response_id,
                "object": "chat.completion.chunk",
                "created": run.created,
                "model": run.model,
                "choices": [choice],
                # vLLM's return_token_ids: the prompt's ids on each choice's first chunk.
                **({"prompt_token_ids": prompt_ids} if prompt_ids is not None else {}),
            }
        )

    async for _, output in run.stream:
        if output.finished:
            final = output
        for completion in output.outputs:
            state = progress.setdefault(completion.index, ChoiceProgress())
            if not state.started:
                state.started = True
                yield chunk(
                    {
                        "index": completion.index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                        **token_id_fields(body, []),
                    },
                    list(output.prompt_token_ids) if body.return_token_ids else None,
                )
            if tools is not None and tools.parses_calls:
                streamer = streamers.setdefault(completion.index, ToolCallStreamer(tools, parser))
                for choice in _tool_delta_choices(body, completion, state, streamer):
                    yield chunk(choice)
                continue
            choice = _delta_choice(body, completion, state)
            if choice is not None:
                yield chunk(choice)
    if body.include_usage:
        yield sse(
            {
                "id": run.response_id,
                "object": "chat.completion.chunk",
                "created": run.created,
                "model": run.model,
                "choices": [],
                "usage": usage(run.prompt_ids, [final]),
            }
        )
    yield sse("[DONE]")


def _delta_choice(
    body: ChatCompletionRequest, completion: CompletionOutput, state: ChoiceProgress
) -> dict[str, Any] | None:
    if state.finished:
        return None
    text = completion.text[state.text_len :]
    finish = completion.finish_reason
    if not text and finish is None:
        return None
    logprobs = None
    if body.logprobs:
        content = _logprob_content(completion, state.num_tokens, body.top_logprobs or 0)
        logprobs = {"content": content}
    ids = token_id_fields(body, completion.token_ids[state.num_tokens :])
    state.text_len = len(completion.text)
    state.num_tokens = len(completion.token_ids)
    state.finished = finish is not None
    return {
        "index": completion.index,
        "delta": {"content": text} if text else {},
        "logprobs": logprobs,
        "finish_reason": finish,
        "stop_reason": completion.stop_reason,
        **ids,
    }


def _tool_delta_choices(
    body: ChatCompletionRequest,
    completion: CompletionOutput,
    state: ChoiceProgress,
    streamer: ToolCallStreamer,
) -> list[dict[str, Any]]:
    """The chunks of a choice that may call tools: content and call deltas, then the
    finish reason on a chunk of its own."""
    if state.finished:
        return []
    finish = completion.finish_reason
    deltas = streamer.deltas(completion.text, finished=finish is not None)
    if not deltas and finish is None:
        return []  # held back: its logprobs go out with the next chunk
    logprobs = None
    if body.logprobs and len(completion.token_ids) > state.num_tokens:
        logprobs = {
            "content": _logprob_content(completion, state.num_tokens, body.top_logprobs or 0)
        }
    ids = token_id_fields(body, completion.token_ids[state.num_tokens :])
    state.num_tokens = len(completion.token_ids)
    choices = [
        {"index": completion.index, "delta": delta, "logprobs": None, "finish_reason": None}
        for delta in deltas
    ]
    if choices:
        choices[0]["logprobs"] = logprobs
        choices[0].update(ids)
    if finish is not None:
        state.finished = True
        choices.append(
            {
                "index": completion.index,
                "delta": {},
                "logprobs": None if choices else logprobs,
                "finish_reason": stream_finish_reason(streamer, finish),
                "stop_reason": completion.stop_reason,
                **({} if choices else ids),
            }
        )
    return choices


def _logprob_content(completion: CompletionOutput, start: int, top_n: int) -> list[dict[str, Any]]:
    entries = completion.logprobs or []
    content = []
    for position in range(start, min(len(completion.token_ids), len(entries))):
        entry = entries[position]
        chosen = entry[completion.token_ids[position]]
        # The entry holds the sampled token plus the top N; the sampled one may rank lower.
        top = sorted((lp for lp in entry.values() if lp.rank <= top_n), key=lambda lp: lp.rank)
        content.append(
            {
                **_token_fields(chosen.decoded_token, chosen.logprob),
                "top_logprobs": [_token_fields(lp.decoded_token, lp.logprob) for lp in top],
            }
        )
    return content


def _token_fields(token: str | None, logprob: float) -> dict[str, Any]:
    text = token or ""
    return {"token": text, "logprob": json_logprob(logprob), "bytes": list(text.encode("utf-8"))}
