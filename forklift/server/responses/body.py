"""The body of POST /v1/responses (pydantic), and the fields forklift refuses.

Every field declared here changes what the server does or is echoed in the response. Any
other field is refused with a 400 naming it: a client that asks for reasoning, background
runs or built-in tools must learn it did not get them."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from forklift.server.errors import APIError

# OpenAI's limits on `metadata`.
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512

# Values of undeclared fields that ask for nothing, so need not be refused.
_NO_OP_VALUES: dict[str, tuple[Any, ...]] = {"background": (False,), "include": ([],)}

_HINTS = {
    "max_tokens": "use max_output_tokens",
    "max_completion_tokens": "use max_output_tokens",
    "messages": "use input",
    "response_format": "use text.format",
    "reasoning": "forklift has no reasoning controls",
    "background": "responses run in the foreground only",
    "include": "there is nothing extra (reasoning, logprobs, sources) to include",
    "conversation": "continue a conversation with previous_response_id",
    "n": "a response has one output",
}


class ResponsesRequest(BaseModel):
    # Unknown fields are kept so that `refuse_unsupported` can name them.
    model_config = ConfigDict(extra="allow")

    input: str | list[dict[str, Any]]
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None  # None: true, OpenAI's default
    text: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    previous_response_id: str | None = None
    parallel_tool_calls: bool | None = None
    truncation: str | None = None

    @field_validator("metadata")
    @classmethod
    def _bounded_metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is None:
            return None
        if len(value) > MAX_METADATA_PAIRS:
            raise ValueError(f"at most {MAX_METADATA_PAIRS} pairs, got {len(value)}")
        for key, text in value.items():
            if len(key) > MAX_METADATA_KEY:
                raise ValueError(f"keys are at most {MAX_METADATA_KEY} characters: {key[:20]!r}…")
            if len(text) > MAX_METADATA_VALUE:
                raise ValueError(f"values are at most {MAX_METADATA_VALUE} characters ({key!r})")
        return value

    @property
    def stores(self) -> bool:
        return self.store is not False

    @property
    def parallel_calls(self) -> bool:
        return self.parallel_tool_calls is not False


def refuse_unsupported(body: ResponsesRequest) -> None:
    """400 naming the first field forklift does not implement, unless it asks for nothing."""
    for name, value in (body.model_extra or {}).items():
        if value is None or value in _NO_OP_VALUES.get(name, ()):
            continue
        hint = _HINTS.get(name)
        message = f"`{name}` is not supported by this server" + (f": {hint}" if hint else "")
        raise APIError(400, message, name)
    if body.truncation not in (None, "disabled"):
        raise APIError(
            400,
            "truncation must be 'disabled': forklift refuses a conversation longer than the "
            "context instead of dropping its start",
            "truncation",
        )
    for key, value in (body.text or {}).items():
        if key != "format" and value is not None:
            raise APIError(400, f"text.{key} is not supported by this server", f"text.{key}")
