"""Tool definitions and `tool_choice` of a chat request: validated, and turned into what the
prompt and the decoder need.

- `none`: the model answers in text; no call is parsed.
- `auto` (the default with tools): the model may call tools; the output is parsed by the
  server's tool-call parser.
- `required`: decoding is constrained to one or more calls in the parser's format, one
  schema branch per tool.
- a named function: decoding is constrained to that function's parameters.

Arguments hold only the parameters a function declares (`closed_schema`).

`parallel_tool_calls: false` allows at most one call. With `auto`, it and a `strict` tool
constrain decoding to one grammar that allows text or calls (call_grammar.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from forklift.server.errors import APIError
from forklift.server.tools.call_grammar import tool_call_grammar
from forklift.structured.params import StructuredOutputsParams


@dataclass(frozen=True)
class ToolChoice:
    mode: str  # "none" | "auto" | "required" | "named"
    name: str | None = None  # the function, when mode == "named"


@dataclass(frozen=True)
class ToolRequest:
    tools: list[dict[str, Any]]  # OpenAI's {"type": "function", "function": {...}}
    choice: ToolChoice
    parallel: bool = True  # parallel_tool_calls: false allows at most one call

    @property
    def functions(self) -> dict[str, dict[str, Any]]:
        return {t["function"]["name"]: t["function"] for t in self.tools}

    @property
    def names(self) -> frozenset[str]:
        return frozenset(self.functions)

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        """What the chat template gets as `tools` (vLLM passes them even for `none`)."""
        return self.tools or None

    @property
    def parses_calls(self) -> bool:
        return bool(self.tools) and self.choice.mode != "none"

    @property
    def has_strict(self) -> bool:
        return any(f.get("strict") is True for f in self.functions.values())

    def constraint(
        self, parser: str, answer: StructuredOutputsParams | None = None
    ) -> StructuredOutputsParams | None:
        """What decoding is held to; `parser` names the format calls are written in and
        `answer` is the request's own output constraint (response_format, ...), if any.

        Forced calls (named, required) cannot also answer in a format: 400. `auto` that needs
        a grammar (strict tools, a single call) takes a JSON `answer` as its text branch;
        plain `auto` leaves decoding to `answer` alone (None here), as before."""
        forced = self.choice.mode in ("named", "required")
        if forced and answer is not None:
            message = f"{answer.param} cannot be combined with a tool_choice that forces a call"
            raise APIError(400, message, answer.param)
        if self.choice.mode == "named":
            parameters = closed_schema(self.functions[self.choice.name or ""]["parameters"])
            return StructuredOutputsParams(json=parameters, param="tool_choice")
        strict = self.has_strict
        needs_grammar = self.choice.mode == "auto" and (strict or not self.parallel)
        if not (forced or needs_grammar):
            return None
        text_schema = None
        if answer is not None:
            if answer.kind not in ("json", "json_object"):
                raise APIError(
                    400,
                    f"{answer.param}: with strict tools or parallel_tool_calls false, the "
                    "answer's format must be a JSON schema or json_object",
                    answer.param,
                )
            text_schema = answer.schema()
        calls, definitions = self._call_schemas(_ARGUMENTS_KEY[parser])
        grammar = tool_call_grammar(
            calls, definitions, parser, self.parallel, needs_grammar, text_schema
        )
        param = "parallel_tool_calls" if needs_grammar and not strict else "tools"
        return StructuredOutputsParams(grammar=grammar, param=param)

    def _call_schemas(self, arguments_key: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """One schema per tool for a call `{"name": ..., arguments_key: {...}}`, and the
        tools' `$defs` gathered for the combined schema's root."""
        calls, definitions = [], {}
        for name, function in self.functions.items():
            parameters = closed_schema(function["parameters"])
            # `#/$defs/X` references (pydantic writes them) point at the document's root:
            # the tools' definitions move up to the combined schema's root.
            found = parameters.pop("$defs", {})
            if not isinstance(found, dict):
                raise APIError(400, f"tools: {name}'s $defs must be an object", "tools")
            for key, schema in found.items():
                if definitions.setdefault(key, schema) != schema:
                    raise APIError(
                        400,
                        f"tools define $defs/{key} differently; one combined schema needs "
                        "one meaning per name",
                        "tools",
                    )
            calls.append(
                {
                    "type": "object",
                    "properties": {"name": {"const": name}, arguments_key: parameters},
                    "required": ["name", arguments_key],
                    "additionalProperties": False,
                }
            )
        return calls, definitions


def closed_schema(schema: Any, closable: bool = True) -> Any:
    """`schema` with every object that lists its `properties` closed to others, unless it
    says otherwise: a call's arguments are the parameters the function declares (OpenAI's
    strict mode asks the same), where JSON Schema alone would let a small model invent keys
    until its tokens run out.

    Only the schema of a value is closed (the root, a property's, an item's, a definition's),
    never a member of allOf / anyOf / oneOf / not / if-then-else, whose keys may come from a
    sibling; nor an object that composes, refers, or requires a key it does not list."""
    if not isinstance(schema, dict):
        return schema
    closed: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            closed[key] = {name: closed_schema(sub) for name, sub in value.items()}
        elif key in _VALUE_SCHEMAS:
            closed[key] = closed_schema(value)
        elif key == "prefixItems" and isinstance(value, list):
            closed[key] = [closed_schema(sub) for sub in value]
        elif key in _COMPOSING and isinstance(value, list):
            closed[key] = [closed_schema(sub, closable=False) for sub in value]
        elif key in _COMPOSING and isinstance(value, dict):
            closed[key] = closed_schema(value, closable=False)
        else:
            closed[key] = value  # data (const, enum, default, ...) or a plain keyword
    properties = closed.get("properties")
    listed = set(properties) if isinstance(properties, dict) else None
    required = closed.get("required", [])
    if (
        closable
        and listed is not None
        and not _OPENING & set(closed)
        and isinstance(required, list)
        and set(required) <= listed
    ):
        closed["additionalProperties"] = False
    return closed


# Maps of names to schemas; single schemas of a value; keywords that compose schemas; and
# keywords beside which an object must stay as it says.
_SCHEMA_MAPS = frozenset({"properties", "$defs", "definitions"})
_VALUE_SCHEMAS = frozenset({"items", "additionalItems", "contains", "additionalProperties"})
_COMPOSING = frozenset({"allOf", "anyOf", "oneOf", "not", "if", "then", "else"})
_OPENING = frozenset(
    {
        "additionalProperties",
        "patternProperties",
        "unevaluatedProperties",
        "dependentSchemas",
        "$ref",
        *_COMPOSING,
    }
)


# The key each parser's call format puts the arguments under.
_ARGUMENTS_KEY = {"hermes": "arguments", "llama3_json": "parameters"}


def tool_request(tools: Any, tool_choice: Any, parallel: bool | None = None) -> ToolRequest | None:
    """Validate `tools`, `tool_choice` and `parallel_tool_calls` (400 naming the field); None
    when there are no tools."""
    if tools is None:
        if tool_choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(tools, list) or not tools:
        raise APIError(400, "tools must be a non-empty list of function tools", "tools")
    checked = [_check_tool(i, tool) for i, tool in enumerate(tools)]
    names = [t["function"]["name"] for t in checked]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise APIError(400, f"tools name the function {duplicate!r} twice", "tools")
    return ToolRequest(checked, _check_choice(tool_choice, set(names)), parallel is not False)


def _check_tool(index: int, tool: Any) -> dict[str, Any]:
    where = f"tools[{index}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise APIError(400, f"{where} must be an object with type 'function'", where)
    function = tool.get("function")
    if not isinstance(function, dict):
        raise APIError(400, f"{where}.function must be an object", f"{where}.function")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise APIError(400, f"{where}.function.name must be a non-empty string", where)
    parameters = function.get("parameters")
    if not isinstance(parameters, dict):
        # Calls are decoded against this schema: without one there is nothing to hold the
        # arguments to. A function without arguments says {"type": "object"}.
        raise APIError(
            400,
            f"{where}.function.parameters must be a JSON schema object "
            '(use {"type": "object", "properties": {}} for no arguments)',
            f"{where}.function.parameters",
        )
    if function.get("strict") not in (None, True, False):
        raise APIError(
            400, f"{where}.function.strict must be true or false", f"{where}.function.strict"
        )
    return {"type": "function", "function": dict(function)}


def _check_choice(choice: Any, names: set[str]) -> ToolChoice:
    if choice is None:
        return ToolChoice("auto")
    if choice in ("none", "auto", "required"):
        return ToolChoice(choice)
    if isinstance(choice, dict) and choice.get("type") == "function":
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or name not in names:
            raise APIError(
                400,
                f"tool_choice names the function {name!r}, which is not among the tools "
                f"({', '.join(sorted(names))})",
                "tool_choice",
            )
        return ToolChoice("named", name)
    raise APIError(
        400,
        "tool_choice must be none, auto, required or "
        '{"type": "function", "function": {"name": ...}}',
        "tool_choice",
    )
