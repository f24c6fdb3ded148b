"""One chat choice's text -> an assistant message with tool calls, whole or as stream deltas."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from forklift.server.tools.parsers import ParsedOutput, ToolCall, ToolCallParser
from forklift.server.tools.tool_choice import ToolRequest


def parse_choice(text: str, tools: ToolRequest, parser: ToolCallParser) -> ParsedOutput:
    mode = tools.choice.mode
    if mode == "named":
        return ParsedOutput("", [ToolCall(tools.choice.name or "", text)])
    return parser.parse(text)


def final_message(
    text: str, finish_reason: str | None, tools: ToolRequest | None, parser: ToolCallParser
) -> tuple[dict[str, Any], str | None]:
    """(message, finish_reason) of a finished choice."""
    if tools is None or not tools.parses_calls:
        return {"role": "assistant", "content": text}, finish_reason
    parsed = parse_choice(text, tools, parser)
    if not parsed.tool_calls:
        return {"role": "assistant", "content": text}, finish_reason
    message = {
        "role": "assistant",
        "content": parsed.content,
        "tool_calls": [call.to_json() for call in parsed.tool_calls],
    }
    # A call cut off by max_tokens stays "length": its arguments may not parse.
    return message, ("tool_calls" if finish_reason == "stop" else finish_reason)


@dataclass
class ToolCallStreamer:
    """Turns a growing choice text into `delta` objects for chat.completion.chunk.

    A named function streams its arguments as they are generated. Otherwise content
    streams until a call begins; calls are sent whole once the choice is finished, with any
    text between or after them (the openai client reassembles either form). Content that
    is only whitespace before a call is held back, as the whole message strips it."""

    tools: ToolRequest
    parser: ToolCallParser
    _sent_content: int = 0
    _sent_arguments: int = 0
    _num_calls: int = 0

    def deltas(self, text: str, finished: bool) -> list[dict[str, Any]]:
        mode = self.tools.choice.mode
        if mode == "named":
            return self._named(text)
        if not finished:
            if mode == "required":
                return []
            start = self.parser.call_start(text)
            end = start if start is not None else self.parser.safe_content_end(text)
            if start is not None and not text[self._sent_content : end].strip():
                return []
            return self._content_up_to(text, end)
        parsed = parse_choice(text, self.tools, self.parser)
        if not parsed.tool_calls:  # no call after all: the whole text is the answer
            return self._content_up_to(text, len(text))
        # Everything streamed so far came before the first call, so it is a prefix of the
        # text outside the calls.
        out = []
        if parsed.content is not None:
            out = self._content_up_to(parsed.raw_content, len(parsed.raw_content))
        return out + self._whole_calls(parsed.tool_calls)

    @property
    def called(self) -> bool:
        return self._num_calls > 0

    def _content_up_to(self, text: str, end: int) -> list[dict[str, Any]]:
        piece = text[self._sent_content : end]
        if not piece:
            return []
        self._sent_content = end
        return [{"content": piece}]

    def _named(self, text: str) -> list[dict[str, Any]]:
        out = []
        if not self._num_calls:  # the call's header goes first, once
            self._num_calls = 1
            header = _call_delta(0, ToolCall(self.tools.choice.name or "", ""))
            out.append({"tool_calls": [header]})
        piece = text[self._sent_arguments :]
        if piece:
            self._sent_arguments = len(text)
            out.append({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]})
        return out

    def _whole_calls(self, calls: list[ToolCall]) -> list[dict[str, Any]]:
        out = []
        for call in calls:
            out.append({"tool_calls": [_call_delta(self._num_calls, call)]})
            self._num_calls += 1
        return out


def _call_delta(index: int, call: ToolCall) -> dict[str, Any]:
    """The first chunk of a call: its id, type and name, with the arguments so far."""
    return {
        "index": index,
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


def stream_finish_reason(
    streamer: ToolCallStreamer | None, finish_reason: str | None
) -> str | None:
    if streamer is not None and streamer.called and finish_reason == "stop":
        return "tool_calls"
    return finish_reason
