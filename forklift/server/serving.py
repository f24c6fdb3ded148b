"""What completions and chat share: model check, request launch, usage, timestamps."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from forklift.core.input_processor import ProcessedPrompt
from forklift.engine.async_engine import AsyncEngine
from forklift.lora_request import LoRARequest
from forklift.outputs import RequestOutput
from forklift.sampling_params import SamplingParams
from forklift.server.errors import APIError, bad_request
from forklift.server.field_policy import FieldPolicy
from forklift.server.limits import ServerLimits, at_most, check_extra_fields
from forklift.server.protocol import ChatCompletionRequest, SamplingFields
from forklift.server.streams import merge_streams
from forklift.server.structured_fields import GUIDED_FIELDS, structured_params
from forklift.server.tools.tool_choice import ToolRequest
from forklift.tokenizer import Tokenizer


@dataclass
class ServerContext:
    async_engine: AsyncEngine
    served_model_name: str
    limits: ServerLimits = field(default_factory=ServerLimits)
    # How `tool_choice: auto` output is read (forklift/server/tools/parsers.py).
    tool_call_parser: str = "hermes"
    # Fields the server refuses, or ignores with a warning (forklift/server/field_policy.py).
    fields: FieldPolicy = field(
        default_factory=lambda: FieldPolicy(understood=frozenset(GUIDED_FIELDS))
    )

    @property
    def tokenizer(self) -> Tokenizer:
        tokenizer = self.async_engine.tokenizer
        if tokenizer is None:
            raise APIError(400, "this model has no tokenizer; send prompts as token ids")
        return tokenizer

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter a request's `model` names, None for the base model; a name
        that is neither is a 404."""
        if model is None or model == self.served_model_name:
            return None
        loras = self.async_engine.loras
        adapter = loras.by_name(model) if loras is not None else None
        if adapter is not None:
            return adapter
        # OpenAI's and vLLM's answer: 404 with code model_not_found.
        raise APIError(
            404,
            f"The model `{model}` does not exist; this server serves "
            f"`{self.served_model_name}`"
            + (f" and the LoRA adapters {self.adapter_names()}." if self.adapter_names() else "."),
            "model",
            code="model_not_found",
        )

    def adapter_names(self) -> list[str]:
        loras = self.async_engine.loras
        return [] if loras is None else [info.name for info in loras.infos()]


@dataclass
class Launch:
    """The running requests of one API call (one per prompt)."""

    response_id: str
    created: int
    prompt_ids: list[list[int]]
    stream: AsyncIterator[tuple[int, RequestOutput]]
    # The `model` the responses name: the served model, or the adapter asked for.
    model: str = ""


async def launch(
    ctx: ServerContext,
    prefix: str,
    prompts: list[str | list[int]],
    params: SamplingParams,
    cache_salt: str | None = None,
    lora: LoRARequest | None = None,
) -> Launch:
    """Tokenize and validate every prompt (text or token ids) first, then start them all; a
    bad one starts none.

    Tokenizing and validation read every token, so they run in a worker thread; queueing
    stays on the event loop, whose streams the engine thread feeds."""
    engine = ctx.async_engine
    salt = {} if cache_salt is None else {"cache_salt": cache_salt}

    def process_all() -> list[ProcessedPrompt]:
        processed = []
        for p in prompts:
            key = "prompt" if isinstance(p, str) else "prompt_token_ids"
            processed.append(engine.process({key: p, **salt}, params))
        return processed

    try:
        processed = await asyncio.to_thread(process_all)
    except ValueError as exc:
        raise bad_request(exc) from exc
    response_id = f"{prefix}-{uuid.uuid4().hex}"
    arrival = time.time()
    requests = [(f"{response_id}-{i}", p) for i, p in enumerate(processed)]
    streams = engine.submit(requests, arrival, lora)
    ids = [p.prompt_token_ids for p in processed]
    model = ctx.served_model_name if lora is None else lora.lora_name
    return Launch(response_id, int(arrival), ids, merge_streams(streams), model)


def make_params(
    ctx: ServerContext,
    body: SamplingFields,
    max_tokens: int | None,
    logprobs: int | None,
    tools: ToolRequest | None = None,
) -> SamplingParams:
    """The request's SamplingParams, its output held to what `tools` and the body's own
    output constraint fields ask together (ToolRequest.constraint). The grammar compiles
    later, in `launch`'s validation."""
    extra = body.model_extra or {}
    check_extra_fields(extra, ctx.limits, ctx.async_engine.config)
    ctx.fields.check(extra, body.n, chat=isinstance(body, ChatCompletionRequest))
    if body.stream and body.prompt_logprobs is not None:
        # As vLLM: the prompt's logprobs come in the whole response only.
        raise APIError(400, "prompt_logprobs is not supported with stream", "prompt_logprobs")
    if body.stream_options is not None and body.stream_options.continuous_usage_stats:
        message = "stream_options.continuous_usage_stats is not supported: usage comes last"
        raise APIError(400, message, "stream_options")
    if body.logit_bias is not None:
        limit = ctx.limits.max_logit_bias
        at_most("logit_bias", len(body.logit_bias), limit, "max_logit_bias")
    asked = structured_params(body.response_format, body.structured_outputs, extra)
    constraint = None
    if tools is not None and tools.parses_calls:
        constraint = tools.constraint(ctx.tool_call_parser, asked)
    try:
        return body.sampling_params(max_tokens, logprobs, constraint or asked)
    except ValueError as exc:
        raise bad_request(exc) from exc


def prompt_logprobs_json(output: RequestOutput | None, top: int | None) -> list[Any] | None:
    """vLLM's `prompt_logprobs` field: per prompt token None (the first) or token id ->
    {logprob, rank, decoded_token}, for the token itself and the `top` best."""
    if output is None or output.prompt_logprobs is None or top is None:
        return None
    fields = []
    for position, entry in enumerate(output.prompt_logprobs):
        if entry is None:
            fields.append(None)
            continue
        token = output.prompt_token_ids[position]
        kept = {t: lp for t, lp in entry.items() if t == token or lp.rank <= top}
        fields.append(
            {
                str(t): {
                    "logprob": json_logprob(lp.logprob),
                    "rank": lp.rank,
                    "decoded_token": lp.decoded_token,
                }
                for t, lp in kept.items()
            }  # fmt: skip
        )
    return fields


# JSON has no -inf: a token the sampling filters dropped (top-k, top-p, min-p, min_tokens)
# has logprob -inf in `processed` mode, reported as OpenAI's floor instead.
MIN_LOGPROB = -9999.0


def token_id_fields(
    body: SamplingFields, token_ids: Sequence[int], prompt_ids: Sequence[int] | None = None
) -> dict[str, Any]:
    """A choice's fields for vLLM's `return_token_ids` (none unless asked): its tokens, and
    where given its prompt's ids."""
    if not body.return_token_ids:
        return {}
    fields: dict[str, Any] = {"token_ids": list(token_ids)}
    if prompt_ids is not None:
        fields["prompt_token_ids"] = list(prompt_ids)
    return fields


def json_logprob(logprob: float) -> float:
    return logprob if logprob > MIN_LOGPROB else MIN_LOGPROB


def usage(prompt_ids: list[list[int]], finals: list[RequestOutput | None]) -> dict[str, Any]:
    prompt_tokens = sum(len(p) for p in prompt_ids)
    completion_tokens = sum(len(c.token_ids) for f in finals if f is not None for c in f.outputs)
    cached_tokens = sum(f.num_cached_tokens for f in finals if f is not None)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


@dataclass
class ChoiceProgress:
    """How much of one choice has been streamed so far."""

    text_len: int = 0
    num_tokens: int = 0
    started: bool = False
    finished: bool = False
