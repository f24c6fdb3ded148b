"""A Responses request's tools, tool_choice and text.format as their chat equivalents, so that
chat's validation, prompts and decoding constraints serve both APIs.

Responses tools are flat (`{"type": "function", "name", "parameters", ...}`) where chat nests
them under `function`; a named tool_choice is `{"type": "function", "name"}`; text.format
is chat's response_format with the json_schema fields one level up.
"""

from __future__ import annotations

from typing import Any

from forklift.server.errors import APIError
from forklift.server.responses.body import ResponsesRequest
from forklift.server.tools.tool_choice import ToolRequest, tool_request

_TOOL_KEYS = {"type", "name", "description", "parameters", "strict"}
_CHOICE_MODES = ("auto", "none", "required")
# OpenAI: `parameters: null` is a function without arguments.
_NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}}


def tool_setup(body: ResponsesRequest) -> ToolRequest | None:
    """The request's tools as chat's; 400 naming the field."""
    tools = _chat_tools(body.tools)
    choice = _chat_tool_choice(body.tool_choice)
    if tools is None and choice in ("auto", "none"):
        choice = None  # nothing to call: OpenAI's defaults ask for nothing
    return tool_request(tools, choice, body.parallel_calls)


def chat_response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` as chat's `response_format`; None for plain text."""
    if text is None or text.get("format") is None:
        return None
    spec = text["format"]
    if not isinstance(spec, dict):
        raise APIError(400, "text.format must be an object with a `type`", "text.format")
    kind = spec.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind != "json_schema":
        raise APIError(
            400,
            f"text.format.type must be text, json_object or json_schema, got {kind!r}",
            "text.format.type",
        )
    name, schema = spec.get("name"), spec.get("schema")
    if not isinstance(name, str) or not name:
        raise APIError(400, "text.format.name must be a non-empty string", "text.format.name")
    if not isinstance(schema, dict):
        raise APIError(400, "text.format.schema must be a JSON schema object", "text.format.schema")
    # Decoding is held to the schema whatever `strict` says: strict or not, the output fits.
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}


def _chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    converted = []
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        kind = tool.get("type")
        if kind != "function":
            raise APIError(
                400,
                f"{where}.type {kind!r} is not supported: this server runs function tools only "
                "(built-in tools such as web_search or file_search are OpenAI's own)",
                f"{where}.type",
            )
        extra = sorted(k for k, v in tool.items() if k not in _TOOL_KEYS and v is not None)
        if extra:
            spot = f"{where}.{extra[0]}"
            raise APIError(400, f"{spot} is not supported by this server", spot)
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise APIError(400, f"{where}.name must be a non-empty string", f"{where}.name")
        if "parameters" not in tool:
            raise APIError(
                400,
                f"{where}.parameters is required (null for a function without arguments)",
                f"{where}.parameters",
            )
        parameters = tool["parameters"]
        if parameters is None:
            parameters = dict(_NO_ARGUMENTS)
        if not isinstance(parameters, dict):
            message = f"{where}.parameters must be a JSON schema object"
            raise APIError(400, message, f"{where}.parameters")
        function: dict[str, Any] = {"name": name, "parameters": parameters}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        if tool.get("strict") is not None:
            function["strict"] = tool["strict"]
        converted.append({"type": "function", "function": function})
    return converted


def _chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or choice in _CHOICE_MODES:
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = choice.get("name")
        if isinstance(name, str) and name and set(choice) <= {"type", "name"}:
            return {"type": "function", "function": {"name": name}}
    raise APIError(
        400,
        'tool_choice must be auto, none, required or {"type": "function", "name": ...}',
        "tool_choice",
    )
