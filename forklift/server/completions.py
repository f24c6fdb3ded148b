"""POST /v1/completions."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
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
    prompt_logprobs_json,
    token_id_fields,
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
    lora = ctx.check_model(body.model)
    if body.suffix:
        raise APIError(400, "suffix is not supported", "suffix")
    # Evaluation harnesses score a prompt with echo, logprobs and max_tokens 0: the prompt's
    # own logprobs, no completion. The engine samples one token, which is dropped.
    echo_only = body.echo and body.max_tokens == 0
    params = make_params(ctx, body, 1 if echo_only else body.max_tokens, body.logprobs)
    if body.echo and body.logprobs is not None:
        top = max(body.logprobs, body.prompt_logprobs or 0)
        params = params.clone(prompt_logprobs=top)
    prompts = prompt_list(ctx, body.prompt)
    run = await launch(ctx, "cmpl", prompts, params, body.cache_salt, lora)
    if echo_only:
        run.stream = _without_completions(run.stream)
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
            logprobs = None
            if body.logprobs is not None:
                logprobs = _prompt_logprobs(ctx, body, output)
                end = len(completion.token_ids)
                _extend(logprobs, _logprobs(ctx, completion, 0, end, len(prefix)))
            choices.append(
                {
                    "index": prompt_index * body.n + completion.index,
                    "text": prefix + completion.text,
                    "logprobs": logprobs,
                    "finish_reason": completion.finish_reason,
                    "stop_reason": completion.stop_reason,
                    "prompt_logprobs": prompt_logprobs_json(output, body.prompt_logprobs)
                    if body.prompt_logprobs is not None
                    else None,
                    **token_id_fields(body, completion.token_ids, run.prompt_ids[prompt_index]),
                }
            )
    return JSONResponse(
        {
            "id": run.response_id,
            "object": "text_completion",
            "created": run.created,
            "model": run.model,
            "choices": choices,
            "usage": usage(run.prompt_ids, outputs),
        }
    )


async def _without_completions(
    stream: AsyncIterator[tuple[int, RequestOutput]],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """max_tokens 0: each output with its sampled token dropped, finished by length."""
    async for index, output in stream:
        if not output.finished:
            continue
        empty = [
            replace(c, text="", token_ids=[], cumulative_logprob=None,
                    logprobs=[] if c.logprobs is not None else None, finish_reason="length",
                    stop_reason=None)
            for c in output.outputs
        ]  # fmt: skip
        yield index, replace(output, outputs=empty)


def _prompt_logprobs(
    ctx: ServerContext, body: CompletionRequest, output: RequestOutput
) -> dict[str, Any]:
    """The echoed prompt's part of the logprobs object (its first token has none)."""
    part: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                            "text_offset": []}  # fmt: skip
    if not body.echo or output.prompt_logprobs is None:
        return part
    offset = 0
    entries = output.prompt_logprobs
    top_n = body.logprobs or 0
    for position, token_id in enumerate(output.prompt_token_ids):
        piece = ctx.tokenizer.token_text(token_id) or ""
        part["tokens"].append(piece)
        part["text_offset"].append(offset)
        offset += len(piece)
        # None for the first token, and for any not scored (a request aborted mid-prefill).
        entry = entries[position] if position < len(entries) else None
        if entry is None:
            part["token_logprobs"].append(None)
            part["top_logprobs"].append(None)
            continue
        part["token_logprobs"].append(json_logprob(entry[token_id].logprob))
        top = {(lp.decoded_token or ""): json_logprob(lp.logprob)
               for t, lp in entry.items() if t == token_id or lp.rank <= top_n}  # fmt: skip
        part["top_logprobs"].append(top)
    return part


def _extend(logprobs: dict[str, Any], more: dict[str, Any]) -> None:
    for key, values in more.items():
        logprobs[key].extend(values)


def _echo_text(ctx: ServerContext, body: CompletionRequest, prompt_ids: list[int]) -> str:
    # With return_token_ids the prompt comes back as ids only (vLLM's rule).
    if not body.echo or body.return_token_ids:
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
                "model": run.model,
                "choices": choices,
            }
        )

    async for prompt_index, output in run.stream:
        if output.finished:
            finals[prompt_index] = output
        for completion in output.outputs:
            index = prompt_index * body.n + completion.index
            state = progress.setdefault(index, ChoiceProgress())
            choice = _delta_choice(ctx, body, run, output, completion, index, state)
            if choice is not None:
                yield chunk([choice])
    if body.include_usage:
        outputs = [finals.get(i) for i in range(len(run.prompt_ids))]
        yield sse(
            {
                "id": run.response_id,
                "object": "text_completion",
                "created": run.created,
                "model": run.model,
                "choices": [],
                "usage": usage(run.prompt_ids, outputs),
            }
        )
    yield sse("[DONE]")


def _delta_choice(
    ctx: ServerContext,
    body: CompletionRequest,
    run: Launch,
    output: RequestOutput,
    completion: CompletionOutput,
    index: int,
    state: ChoiceProgress,
) -> dict[str, Any] | None:
    if state.finished:
        return None
    text = completion.text[state.text_len :]
    echo = "" if state.started else _echo_text(ctx, body, output.prompt_token_ids)
    text = echo + text
    finish = completion.finish_reason
    if not text and finish is None:
        return None
    ids = token_id_fields(
        body,
        completion.token_ids[state.num_tokens :],
        output.prompt_token_ids if not state.started else None,
    )
    logprobs = None
    if body.logprobs is not None:
        prompt_part = _prompt_logprobs(ctx, body, output) if not state.started else None
        logprobs = _logprobs(
            ctx, completion, state.num_tokens, len(completion.token_ids),
            len(echo) + state.text_len,
        )  # fmt: skip
        if prompt_part is not None:
            _extend(prompt_part, logprobs)
            logprobs = prompt_part
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
        **ids,
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
