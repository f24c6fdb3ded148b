"""Request bodies of the OpenAI-compatible API (pydantic), and their SamplingParams."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from forklift.sampling_params import SamplingParams
from forklift.structured.params import StructuredOutputsParams


class StreamOptions(BaseModel):
    include_usage: bool = False
    # vLLM's usage on every chunk: refused when true (forklift/server/serving.py).
    continuous_usage_stats: bool = False


class SamplingFields(BaseModel):
    """Fields shared by completions and chat, OpenAI's plus forklift's extras."""

    # Unknown fields are accepted and ignored, as OpenAI clients send many optional ones.
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    # forklift / vLLM extras at the top level of the body.
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs_mode: str = "processed"
    # Requests with different salts never share prefix-cache blocks.
    cache_salt: str | None = None
    # Output constraints (forklift/server/structured_fields.py); vLLM's guided_* arrive as extras.
    response_format: Any = None
    structured_outputs: Any = None
    # OpenAI's token id (a string in JSON) -> bias in [-100, 100]; vLLM's token choices.
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # vLLM's: each prompt token's logprob and the top N (`prompt_logprobs` in the response).
    prompt_logprobs: int | None = None
    # vLLM's: the prompt's and each choice's token ids beside the text (streamed: the prompt's
    # on a choice's first chunk, each chunk's new tokens).
    return_token_ids: bool | None = None

    def sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        structured: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            logprobs_mode=self.logprobs_mode,
            skip_special_tokens=self.skip_special_tokens,
            structured_outputs=structured,
            logit_bias=_token_bias(self.logit_bias),
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            prompt_logprobs=self.prompt_logprobs,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def _token_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """JSON object keys are strings: each must spell a token id."""
    if bias is None:
        return None
    parsed = {}
    for key, value in bias.items():
        if not key.strip().isdigit():
            raise ValueError(f"SamplingParams.logit_bias keys must be token ids, got {key!r}")
        parsed[int(key)] = value
    return parsed


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None


class TokenizeRequest(BaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int] = Field(default_factory=list)


ErrorType = Literal[
    "invalid_request_error", "authentication_error", "not_found_error", "server_error"
]
