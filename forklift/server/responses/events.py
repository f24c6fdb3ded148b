"""Streamed output of POST /v1/responses: chat-style deltas -> Responses server-sent events.

The deltas are the ones chat streams (`{"content"}`, `{"tool_calls": [...]}`, from
`ToolCallStreamer` when tools are parsed): text opens a message item, a call's first delta
(the one with its id) opens a function_call item and closes whatever was open before it.
Items close, in order, once the generation is finished.
"""

from __future__ import annotations

import json
from typing import Any

from forklift.server.responses.output import (
    function_call_item,
    message_item,
    new_id,
    text_part,
)


def event(kind: str, sequence_number: int, **fields: Any) -> str:
    data = {"type": kind, "sequence_number": sequence_number, **fields}
    return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


class StreamedOutput:
    """The output items of one streamed response and the events that build them."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self._sequence = 0
        self._open: dict[str, Any] | None = None  # the item receiving deltas
        self._text = ""  # of the open message, or the open call's arguments
        # Whitespace before anything else is held back: if a call follows, it is no message.
        self._pending = ""

    def event(self, kind: str, **fields: Any) -> str:
        line = event(kind, self._sequence, **fields)
        self._sequence += 1
        return line

    def feed(self, delta: dict[str, Any]) -> list[str]:
        events: list[str] = []
        if delta.get("content"):
            events += self._text_delta(delta["content"])
        for call in delta.get("tool_calls") or []:
            function = call.get("function") or {}
            if call.get("id") is not None:
                events += self._close("completed")
                self._pending = ""
                item = function_call_item(
                    new_id("fc"), call["id"], function.get("name", ""), "", "in_progress"
                )
                events += self._add(item)
            if function.get("arguments"):
                events += self._arguments_delta(function["arguments"])
        return events

    def finish(self, status: str) -> list[str]:
        """Close the last item with `status` (completed, or incomplete when cut off)."""
        if not self.items:  # no call: whatever text there was is the answer, even none
            events = self._open_message()
            if self._pending:
                events += self._emit_text(self._pending)
                self._pending = ""
            return events + self._close(status)
        return self._close(status)

    def _text_delta(self, piece: str) -> list[str]:
        events: list[str] = []
        if self._open is None or self._open["type"] != "message":
            piece, self._pending = self._pending + piece, ""
            if not piece.strip():
                self._pending = piece
                return []
            events += self._close("completed") + self._open_message()
        return events + self._emit_text(piece)

    def _emit_text(self, piece: str) -> list[str]:
        item = self._open
        assert item is not None and item["type"] == "message"
        self._text += piece
        return [
            self.event(
                "response.output_text.delta",
                item_id=item["id"],
                output_index=len(self.items) - 1,
                content_index=0,
                delta=piece,
                logprobs=[],
            )
        ]

    def _open_message(self) -> list[str]:
        item = message_item(new_id("msg"), None, "in_progress")
        events = self._add(item)
        return events + [
            self.event(
                "response.content_part.added",
                item_id=item["id"],
                output_index=len(self.items) - 1,
                content_index=0,
                part=text_part(""),
            )
        ]

    def _arguments_delta(self, piece: str) -> list[str]:
        item = self._open
        assert item is not None and item["type"] == "function_call"
        self._text += piece
        return [
            self.event(
                "response.function_call_arguments.delta",
                item_id=item["id"],
                output_index=len(self.items) - 1,
                delta=piece,
            )
        ]

    def _add(self, item: dict[str, Any]) -> list[str]:
        self.items.append(item)
        self._open, self._text = item, ""
        return [
            self.event("response.output_item.added", output_index=len(self.items) - 1, item=item)
        ]

    def _close(self, status: str) -> list[str]:
        item = self._open
        if item is None:
            return []
        index = len(self.items) - 1
        where = {"item_id": item["id"], "output_index": index}
        events = []
        if item["type"] == "message":
            part = text_part(self._text)
            events.append(
                self.event(
                    "response.output_text.done",
                    **where,
                    content_index=0,
                    text=self._text,
                    logprobs=[],
                )
            )
            events.append(
                self.event("response.content_part.done", **where, content_index=0, part=part)
            )
            item["content"] = [part]
        else:
            item["arguments"] = self._text
            events.append(
                self.event(
                    "response.function_call_arguments.done",
                    **where,
                    name=item["name"],
                    arguments=self._text,
                )
            )
        item["status"] = status
        events.append(self.event("response.output_item.done", output_index=index, item=item))
        self._open, self._text = None, ""
        return events
