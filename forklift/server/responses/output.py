"""The response object of POST /v1/responses: output items, status, usage, echoed settings."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from forklift.outputs import RequestOutput
from forklift.server.responses.body import ResponsesRequest
from forklift.server.serving import usage


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": []}


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [text_part(text)]
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": content,
    }


def function_call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: str
) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def output_items(message: dict[str, Any], last_status: str) -> list[dict[str, Any]]:
    """A finished chat message (`final_message`) as output items: its text, then its calls;
    the last one has `last_status` (incomplete when cut off)."""
    calls = message.get("tool_calls") or []
    items = []
    if message.get("content") or not calls:
        items.append(message_item(new_id("msg"), message.get("content") or "", "completed"))
    for call in calls:
        function = call["function"]
        items.append(
            function_call_item(
                new_id("fc"), call["id"], function["name"], function["arguments"], "completed"
            )
        )
    items[-1]["status"] = last_status
    return items


def response_usage(prompt_ids: list[list[int]], final: RequestOutput | None) -> dict[str, Any]:
    counts = usage(prompt_ids, [final])
    return {
        "input_tokens": counts["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": counts["prompt_tokens_details"]["cached_tokens"]},
        "output_tokens": counts["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": counts["total_tokens"],
    }


@dataclass(frozen=True)
class Outcome:
    """How a response ended, from its finish reason."""

    status: str  # in_progress | completed | incomplete | failed
    incomplete_details: dict[str, str] | None = None
    error: dict[str, str] | None = None

    @property
    def last_item_status(self) -> str:
        """The status of the output item being written when the response ended."""
        return "completed" if self.status == "completed" else "incomplete"

    @classmethod
    def of(cls, finish_reason: str | None) -> Outcome:
        if finish_reason == "length":
            return cls("incomplete", {"reason": "max_output_tokens"})
        if finish_reason == "abort":
            return cls("failed", error={"code": "server_error", "message": "request aborted"})
        return cls("completed")


@dataclass(frozen=True)
class ResponseFrame:
    """What every version of one response (created, in progress, final) has in common."""

    id: str
    created_at: int
    model: str
    body: ResponsesRequest

    def build(
        self,
        output: list[dict[str, Any]],
        outcome: Outcome,
        usage: dict[str, Any] | None,
    ) -> dict[str, Any]:
        body = self.body
        text_format = (body.text or {}).get("format") or {"type": "text"}
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": outcome.status,
            "incomplete_details": outcome.incomplete_details,
            "error": outcome.error,
            "model": self.model,
            "output": output,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "text": {"format": text_format},
            "tools": body.tools or [],
            "tool_choice": body.tool_choice or "auto",
            "parallel_tool_calls": body.parallel_calls,
            "truncation": "disabled",
            "previous_response_id": body.previous_response_id,
            "store": body.stores,
            "metadata": body.metadata or {},
            "user": body.user,
            "usage": usage,
        }
