"""Tools in the prompt: through the chat template when it knows them, else as instructions.

Templates that render `tools` themselves (Qwen, Llama 3.1, Hermes, Mistral) get the list as
HF's `apply_chat_template` passes it. A template that never mentions tools (SmolLM2's, for
one) would drop them silently, so the tools and the call format of the server's parser are
described in a system message instead, and earlier calls and results are written out as
text the model can read.
"""

from __future__ import annotations

import json
from typing import Any

from forklift.server.tools import ToolRequest

_CALL_FORMATS = {
    "hermes": (
        "To call a function, answer with one block per call:\n"
        '<tool_call>\n{"name": <function name>, "arguments": <arguments object>}\n</tool_call>'
    ),
    "llama3_json": (
        "To call a function, answer with only a JSON object "
        '{"name": <function name>, "parameters": <arguments object>}; '
        "separate several calls with a semicolon."
    ),
}


def template_knows_tools(template: str | None) -> bool:
    return bool(template) and "tools" in (template or "")


def prepare_conversation(
    conversation: list[dict[str, Any]],
    tools: ToolRequest | None,
    template: str | None,
    parser: str,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools for the template) for one chat request."""
    if template_knows_tools(template):
        return conversation, tools.template_tools if tools else None
    messages = [_as_text(message, parser) for message in conversation]
    if tools is not None and tools.choice.mode != "none":
        messages = _with_instructions(messages, _instructions(tools, parser))
    return messages, None


def _instructions(tools: ToolRequest, parser: str) -> str:
    listing = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools.tools)
    return (
        "You can call these functions:\n"
        f"<tools>\n{listing}\n</tools>\n"
        f"{_CALL_FORMATS[parser]}\n"
        "Answer in plain text when no function is needed."
    )


def _with_instructions(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    if messages and messages[0].get("role") == "system":
        first = messages[0]
        merged = f"{first.get('content') or ''}\n\n{text}".strip()
        return [{**first, "content": merged}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def _as_text(message: dict[str, Any], parser: str) -> dict[str, Any]:
    """An assistant turn's tool calls and a tool result, written as plain text."""
    calls = message.get("tool_calls")
    if message.get("role") == "assistant" and calls:
        written = [_written_call(call, parser) for call in calls if isinstance(call, dict)]
        text = "\n".join(filter(None, [_text_of(message.get("content")), *written]))
        return {"role": "assistant", "content": text}
    if message.get("role") == "tool":
        return {"role": "tool", "content": _text_of(message.get("content")) or ""}
    return message


def _written_call(call: dict[str, Any], parser: str) -> str:
    function = call.get("function") or {}
    arguments = function.get("arguments") or "{}"
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError:
        parsed = arguments
    if parser == "llama3_json":
        return json.dumps({"name": function.get("name"), "parameters": parsed})
    body = json.dumps({"name": function.get("name"), "arguments": parsed})
    return f"<tool_call>\n{body}\n</tool_call>"


def _text_of(content: Any) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)
