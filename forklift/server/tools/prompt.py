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

from forklift.server.errors import APIError
from forklift.server.tools.tool_choice import ToolRequest

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
    """(messages, tools for the template) for one chat request; 400 naming the message when
    a tool call or tool result is malformed."""
    for index, message in enumerate(conversation):
        _check_message(index, message)
    if template_knows_tools(template):
        # Templates write `arguments | tojson`: they expect the object, not its JSON text.
        messages = [_with_argument_objects(m) for m in conversation]
        return messages, tools.template_tools if tools else None
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
        merged = f"{_text_of(first.get('content')) or ''}\n\n{text}".strip()
        return [{**first, "content": merged}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def _check_message(index: int, message: dict[str, Any]) -> None:
    where = f"messages[{index}]"
    calls = message.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list):
            raise APIError(400, f"{where}.tool_calls must be a list", f"{where}.tool_calls")
        for position, call in enumerate(calls):
            function = call.get("function") if isinstance(call, dict) else None
            name = function.get("name") if isinstance(function, dict) else None
            arguments = function.get("arguments") if isinstance(function, dict) else None
            if not isinstance(name, str) or not isinstance(arguments, str | dict | None):
                spot = f"{where}.tool_calls[{position}]"
                raise APIError(
                    400,
                    f"{spot} must be {{'function': {{'name': str, 'arguments': JSON text}}}}",
                    spot,
                )
    content = message.get("content")
    if isinstance(content, list) and not all(
        isinstance(part, dict) and isinstance(part.get("text"), str) for part in content
    ):
        raise APIError(400, f"{where}.content parts must carry text", f"{where}.content")


def _with_argument_objects(message: dict[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if not calls:
        return message
    rewritten = []
    for call in calls:
        function = dict(call["function"])
        if isinstance(function.get("arguments"), str):
            try:
                function["arguments"] = json.loads(function["arguments"])
            except json.JSONDecodeError:
                pass  # left as the text the client sent
        rewritten.append({**call, "function": function})
    return {**message, "tool_calls": rewritten}


def _as_text(message: dict[str, Any], parser: str) -> dict[str, Any]:
    """An assistant turn's tool calls and a tool result, written as plain text."""
    calls = message.get("tool_calls")
    if message.get("role") == "assistant" and calls:
        written = [_written_call(call, parser) for call in calls]
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
    if isinstance(content, list):  # parts, checked by _check_message
        return "\n".join(part["text"] for part in content)
    return str(content)
