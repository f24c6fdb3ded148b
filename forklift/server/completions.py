"""POST /v1/completions."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse

from forklift.outputs import CompletionOutput, RequestOutput
from forklift.server.errors import APIError
from forklift.server.limits import at_most
from forklift.server.protocol import CompletionRequest
from forklift.server.serving import (
    ChoiceProgress,
    Launch,
    ServerContext,
    json_logprob,
    launch,
    make_params,
    usage,
)
from forklift.server.streams import collect_unless_disconnected, sse


def prompt_list(ctx: ServerContext, prompt: Any) -> list[str | list[int]]:
    """A string, list of strings, token ids or list of token-id lists -> one prompt each
    (text stays text: the engine's input processor tokenizes it with the validation)."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", "prompt")
    if all(isinstance(t, int) for t in prompt):
        return [list(prompt)]
    limit = ctx.limits.max_prompts_per_request
    at_most("prompt", len(prompt), limit, "max_prompts_per_request")
    return [p if isinstance(p, str) else list(p) for p in prompt]


async def create_completion(
    ctx: ServerContext, body: CompletionRequest, is_disconnected: Callable[[], Awaitable[bool]]
) -> JSONResponse | StreamingResponse | None:
    ctx.check_model(body.model)
    if body.suffix:
        raise APIError(400, "suffix is not supported", "suffix")
    params = make_params(ctx, body, body.max_tokens, body.logprobs)
    prompts = prompt_list(ctx, body.prompt)
    run = await launch(ctx, "cmpl", prompts, params, body.cache_salt)
    if body.stream:
        return StreamingResponse(_stream(ctx, body, run), media_type="text/event-stream")
    finals = await collect_unless_disconnected(run.stream, is_disconnected)
    if finals is None:
        return None
    outputs = [finals.get(i) for i in range(len(run.prompt_ids))]
    choices = []
    for prompt_index, output in enumerate(outputs):
        assert output is not None
        prefix = _echo_text(ctx, body, run.prompt_ids[prompt_index])
        for completion in output.outputs:
            choices.append(
                {
                    "index": prompt_index * body.n + completion.index,
                    "text": prefix + completion.text,
                    "logprobs": _logprobs(ctx, completion, 0, len(completion.token_ids), 0)
                    if body.logprobs is not None
                    else None,
                    "finish_reason": completion.finish_reason,
                    "stop_reason": completion.stop_reason,
                }
            )
    return JSONResponse(
        {
            "id": run.response_id,
            "object": "text_completion",
            "created": run.created,
            "model": ctx.served_model_name,
            "choices": choices,
            "usage": usage(run.prompt_ids, outputs),
        }
    )


def _echo_text(ctx: ServerContext, body: CompletionRequest, prompt_ids: list[int]) -> str:
    if not body.echo:
        return ""
    return ctx.tokenizer.decode(prompt_ids, skip_special_tokens=False)


async def _stream(ctx: ServerContext, body: CompletionRequest, run: Launch) -> AsyncIterator[str]:
    progress: dict[int, ChoiceProgress] = {}
    finals: dict[int, RequestOutput] = {}

    def chunk(choices: list[dict[str, Any]]) -> str:
        return sse(
            {
                "id": run.response_id,
                "object": "text_completion",
                "created": run.created,
                "model": ctx.served_model_name,
                "choices": choices,
            }
        )

    async for prompt_index, output in run.stream:
        if output.finished:
            finals[prompt_index] = output
        for completion in output.outputs:
            index = prompt_index * body.n + completion.index
            state = progress.setdefault(index, ChoiceProgress())
            choice = _delta_choice(ctx, body, run, prompt_index, completion, index, state)
            if choice is not None:
                yield chunk([choice])
    if body.include_usage:
        outputs = [finals.get(i) for i in range(len(run.prompt_ids))]
        yield sse(
            {
                "id": run.response_id,
                "object": "text_completion",
                "created": run.created,
                "model": ctx.served_model_name,
                "choices": [],
                "usage": usage(run.prompt_ids, outputs),
            }
        )
    yield sse("[DONE]")


def _delta_choice(
    ctx: ServerContext,
    body: CompletionRequest,
    run: Launch,
    prompt_index: int,
    completion: CompletionOutput,
    index: int,
    state: ChoiceProgress,
) -> dict[str, Any] | None:
    if state.finished:
        return None
    text = completion.text[state.text_len :]
    if not state.started:
        text = _echo_text(ctx, body, run.prompt_ids[prompt_index]) + text
    finish = completion.finish_reason
    if not text and finish is None:
        return None
    logprobs = None
    if body.logprobs is not None:
        logprobs = _logprobs(
            ctx, completion, state.num_tokens, len(completion.token_ids), state.text_len
        )
    state.started = True
    state.text_len = len(completion.text)
    state.num_tokens = len(completion.token_ids)
    state.finished = finish is not None
    return {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": finish,
        "stop_reason": completion.stop_reason,
    }


def _logprobs(
    ctx: ServerContext, completion: CompletionOutput, start: int, end: int, offset: int
) -> dict[str, Any]:
    """OpenAI's legacy logprobs object for tokens [start, end) of a completion."""
    tokens, token_logprobs, top, text_offset = [], [], [], []
    entries = completion.logprobs or []
    for position in range(start, min(end, len(entries))):
        token_id = completion.token_ids[position]
        entry = entries[position]
        chosen = entry[token_id]
        piece = chosen.decoded_token or ""
        tokens.append(piece)
        token_logprobs.append(json_logprob(chosen.logprob))
        top.append({(lp.decoded_token or ""): json_logprob(lp.logprob) for lp in entry.values()})
        text_offset.append(offset)
        offset += len(piece)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": text_offset,
    }
