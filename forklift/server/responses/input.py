"""Responses input items -> chat messages for the model's chat template.

Items are checked and normalized once, on arrival, to three shapes, which is also how a
stored conversation keeps them:

- `{"type": "message", "role", "content": str}`: roles user, system, developer, assistant;
  content a string or a list of input_text / output_text parts, joined;
- `{"type": "function_call", "call_id", "name", "arguments"}`: an earlier call, which joins
  the assistant turn before it;
- `{"type": "function_call_output", "call_id", "output": str}`: a tool result.
"""

from __future__ import annotations

from typing import Any

from forklift.server.errors import APIError

# Chat templates know system but rarely developer: OpenAI's developer role is its successor.
_CHAT_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_TEXT_PARTS = ("input_text", "output_text")
# Keys an item may carry besides the ones it is read for: ids and statuses of echoed output.
_MESSAGE_KEYS = {"type", "role", "content", "id", "status"}
_CALL_KEYS = {"type", "call_id", "name", "arguments", "id", "status"}
_OUTPUT_KEYS = {"type", "call_id", "output", "id", "status"}
_PART_KEYS = {"type", "text", "annotations", "logprobs"}


def input_items(value: str | list[dict[str, Any]], where: str = "input") -> list[dict[str, Any]]:
    """`input` (or a response's output) as normalized items; 400 naming the bad item."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if not value:
        raise APIError(400, f"{where} must not be empty", where)
    return [_normalized(f"{where}[{i}]", item) for i, item in enumerate(value)]


def chat_messages(items: list[dict[str, Any]], instructions: str | None) -> list[dict[str, Any]]:
    """The conversation as chat messages; `instructions` lead as a system message."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    calls: set[str] = set()
    for item in items:
        kind = item["type"]
        if kind == "message":
            messages.append({"role": _CHAT_ROLES[item["role"]], "content": item["content"]})
        elif kind == "function_call":
            calls.add(item["call_id"])
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            if item["call_id"] not in calls:
                # A result must answer a call the model made earlier in this conversation.
                raise APIError(
                    400,
                    f"no function_call with call_id {item['call_id']!r} comes before its "
                    "function_call_output",
                    "input",
                )
            messages.append(
                {"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]}
            )
    return messages


def _normalized(where: str, item: Any) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise APIError(400, f"{where} must be an object", where)
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        _only_keys(where, item, _MESSAGE_KEYS)
        role = item.get("role")
        if role not in _CHAT_ROLES:
            roles = ", ".join(_CHAT_ROLES)
            message = f"{where}.role must be one of {roles}, got {role!r}"
            raise APIError(400, message, f"{where}.role")
        return {"type": "message", "role": role, "content": _text(f"{where}.content", item)}
    if kind == "function_call":
        _only_keys(where, item, _CALL_KEYS)
        call_id, name = _string(where, item, "call_id"), _string(where, item, "name")
        # Empty arguments: a call cut off by max_output_tokens before they began.
        arguments = _string(where, item, "arguments", allow_empty=True)
        return {"type": "function_call", "call_id": call_id, "name": name, "arguments": arguments}
    if kind == "function_call_output":
        _only_keys(where, item, _OUTPUT_KEYS)
        call_id = _string(where, item, "call_id")
        output = _text(f"{where}.output", {"content": item.get("output")})
        return {"type": "function_call_output", "call_id": call_id, "output": output}
    raise APIError(
        400,
        f"{where}.type {kind!r} is not supported: input items are messages, function_call "
        "and function_call_output",
        f"{where}.type",
    )


def _text(where: str, item: dict[str, Any]) -> str:
    content = item.get("content")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or a list of text parts", where)
    texts = []
    for index, part in enumerate(content):
        spot = f"{where}[{index}]"
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
            kind = part.get("type") if isinstance(part, dict) else None
            raise APIError(
                400,
                f"{spot} is {kind!r}: this server reads only input_text and output_text parts",
                f"{spot}.type",
            )
        _only_keys(spot, part, _PART_KEYS)
        texts.append(_string(spot, part, "text", allow_empty=True))
    # OpenAI's parts are consecutive pieces of one text (the SDK's output_text joins them).
    return "".join(texts)


def _string(where: str, item: dict[str, Any], key: str, allow_empty: bool = False) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not (value or allow_empty):
        kind = "a string" if allow_empty else "a non-empty string"
        raise APIError(400, f"{where}.{key} must be {kind}", f"{where}.{key}")
    return value


def _only_keys(where: str, item: dict[str, Any], allowed: set[str]) -> None:
    extra = sorted(k for k, v in item.items() if k not in allowed and v is not None)
    if extra:
        spot = f"{where}.{extra[0]}"
        raise APIError(400, f"{spot} is not supported by this server", spot)
