"""Model output -> content and tool calls, in the formats chat templates teach models.

- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Hermes, Qwen
  2 / 2.5 / 3, and the instructions forklift adds to templates that know no tools).
- `llama3_json`: a JSON object `{"name": ..., "parameters": {...}}`, optionally after
  `<|python_tag|>`, several separated by `;` (Llama 3.1 / 3.2).

Each parser also says where a call starts in text still being generated, so streaming can
send the content before it and hold the call back until it is complete.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

PARSERS = ("hermes", "llama3_json")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class ParsedOutput:
    # The text outside the calls, as generated (streaming sends exactly this).
    raw_content: str
    tool_calls: list[ToolCall]

    @property
    def content(self) -> str | None:
        return self.raw_content.strip() or None


class ToolCallParser:
    """Base: subclasses find calls in finished text and call starts in partial text.

    With `tool_names`, only calls of those functions count; anything else that merely looks
    like a call stays text."""

    # Text a call may begin with; a partial one at the end of streamed text is held back.
    start_marker = ""

    def __init__(self, tool_names: frozenset[str] | None = None) -> None:
        self.tool_names = tool_names

    def _known(self, call: ToolCall | None) -> ToolCall | None:
        if call is None or (self.tool_names is not None and call.name not in self.tool_names):
            return None
        return call

    def parse(self, text: str) -> ParsedOutput:
        raise NotImplementedError

    def call_start(self, text: str) -> int | None:
        """Index where the first call begins, or None if none has begun."""
        raise NotImplementedError

    def safe_content_end(self, text: str) -> int:
        """How much of `text` (no call begun yet) can stream as content now: all but a
        suffix that could be the start of a call."""
        marker = self.start_marker
        for size in range(min(len(marker) - 1, len(text)), 0, -1):
            if marker.startswith(text[-size:]):
                return len(text) - size
        return len(text)


class HermesParser(ToolCallParser):
    start_marker = "<tool_call>"
    end_marker = "</tool_call>"

    def parse(self, text: str) -> ParsedOutput:
        calls: list[ToolCall] = []
        content: list[str] = []
        rest = text
        while True:
            start = rest.find(self.start_marker)
            if start < 0:
                content.append(rest)
                break
            content.append(rest[:start])
            body_start = start + len(self.start_marker)
            end = rest.find(self.end_marker, body_start)
            body = rest[body_start:] if end < 0 else rest[body_start:end]
            call = self._known(_call_from_json(body, ("arguments", "parameters"), False))
            if call is None:  # not a call after all: keep it as text
                content.append(
                    rest[start:] if end < 0 else rest[start : end + len(self.end_marker)]
                )
            else:
                calls.append(call)
            if end < 0:
                break
            rest = rest[end + len(self.end_marker) :]
        return ParsedOutput("".join(content), calls)

    def call_start(self, text: str) -> int | None:
        index = text.find(self.start_marker)
        return index if index >= 0 else None


class Llama3JsonParser(ToolCallParser):
    start_marker = "<|python_tag|>"

    def parse(self, text: str) -> ParsedOutput:
        start = self.call_start(text)
        if start is None:
            return ParsedOutput(text, [])
        body = text[start:].removeprefix(self.start_marker).strip()
        calls = []
        for piece in _split_json_objects(body):
            # Any JSON object might carry a "name": only a known function with its
            # parameters is a call.
            call = self._known(_call_from_json(piece, ("parameters", "arguments"), True))
            if call is None:
                return ParsedOutput(text, [])
            calls.append(call)
        return ParsedOutput(text[:start], calls)

    def call_start(self, text: str) -> int | None:
        index = text.find(self.start_marker)
        if index >= 0:
            return index
        stripped = text.lstrip()
        return len(text) - len(stripped) if stripped.startswith("{") else None

    def safe_content_end(self, text: str) -> int:
        if not text.strip():
            return 0  # the answer may still open with a JSON call
        return super().safe_content_end(text)


def make_parser(name: str, tool_names: frozenset[str] | None = None) -> ToolCallParser:
    if name == "hermes":
        return HermesParser(tool_names)
    if name == "llama3_json":
        return Llama3JsonParser(tool_names)
    raise ValueError(f"tool_call_parser must be one of {', '.join(PARSERS)}, got {name!r}")


def _call_from_json(
    text: str, argument_keys: tuple[str, ...], require_arguments: bool
) -> ToolCall | None:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    return _call_from_value(value, argument_keys, require_arguments)


def _call_from_value(
    value: Any, argument_keys: tuple[str, ...], require_arguments: bool
) -> ToolCall | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    if require_arguments and not any(k in value for k in argument_keys):
        return None
    arguments = next((value[k] for k in argument_keys if k in value), {})
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(value["name"], text)


def _split_json_objects(text: str) -> list[str]:
    """`{...}; {...}` -> each object's text (semicolons inside strings are left alone)."""
    decoder = json.JSONDecoder()
    pieces, index = [], 0
    while index < len(text):
        try:
            _, end = decoder.raw_decode(text, index)
        except json.JSONDecodeError:
            return [text[index:]]  # not JSON: the caller treats it as text
        pieces.append(text[index:end])
        index = end
        while index < len(text) and text[index] in " \t\n;":
            index += 1
    return pieces
