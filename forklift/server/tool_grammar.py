"""Grammars for tool calls in the server parser's format, whose arguments follow their
tool's schema.

`tool_choice: required` is calls only. `auto` allows both answers, plain text or calls, and
is constrained only when the request needs a promise that free decoding cannot keep: a
`strict` tool (OpenAI: a call's arguments match the schema exactly) or
`parallel_tool_calls: false` (at most one call). Text is any text in which no call begins; a
call is the parser's wrapper around a JSON object held to the union of the tools' call
schemas. Calls are written as the prompt teaches them, so a model ends after its last one
(a JSON array of calls invites a small model to add items until its tokens run out).
"""

from __future__ import annotations

import json
from typing import Any

# Compact JSON inside calls, as for other constraints: small models given free whitespace
# tend to spend their budget on newlines.
_COMPACT_JSON = {"whitespace_flexible": False}


def tool_call_grammar(
    call_schemas: list[dict[str, Any]],
    definitions: dict[str, Any],
    parser: str,
    parallel: bool,
    allow_text: bool,
    text_schema: dict[str, Any] | None = None,
) -> str:
    """A Lark grammar (llguidance's dialect) for calls as `parser` writes them, or with
    `allow_text` (`auto`) text instead: any text, or with `text_schema` (the request's
    response_format) a JSON value of that schema."""
    schema: dict[str, Any] = {"anyOf": call_schemas, "x-guidance": _COMPACT_JSON}
    if definitions:
        schema["$defs"] = definitions
    call_json = f"%json {json.dumps(schema, ensure_ascii=False)}"
    if parser == "hermes":
        grammar = _hermes(call_json, parallel, allow_text)
    elif parser == "llama3_json":
        grammar = _llama3_json(call_json, parallel, allow_text)
    else:
        raise ValueError(f"no tool grammar for the parser {parser!r}")
    if text_schema is None or not allow_text:
        return grammar
    # The answer is the response_format's JSON instead of free text, and calls start the
    # reply (free text before a call would make every JSON answer look like its start).
    calls_only = tool_call_grammar(call_schemas, definitions, parser, parallel, False)
    start, rest = calls_only.split("\n", 1)
    answer = json.dumps({**text_schema, "x-guidance": _COMPACT_JSON}, ensure_ascii=False)
    return "\n".join(
        [start.replace("start: ", "start: answer | ", 1), rest, f"answer: %json {answer}"]
    )


def _hermes(call_json: str, parallel: bool, allow_text: bool) -> str:
    # `<tool_call>\n{...}\n</tool_call>` blocks after optional text, one per line. TEXT and
    # LEAD may hold no `<tool_call>` of their own, so where the first call starts is never
    # ambiguous.
    more = '("\\n<tool_call>\\n" call)*' if parallel else ""
    start = f"TEXT | LEAD call {more}" if allow_text else f'"<tool_call>\\n" call {more}'
    return "\n".join(
        [
            f"start: {start}",
            r"TEXT: /(?s:.*)/ & ~/(?s:.*<tool_call>.*)/",
            r"LEAD: /(?s:.*)<tool_call>\n/ & ~/(?s:.*<tool_call>.*<tool_call>.*)/",
            r'call: arguments "\n</tool_call>"',
            f"arguments: {call_json}",
        ]
    )


def _llama3_json(call_json: str, parallel: bool, allow_text: bool) -> str:
    # A reply is either text that does not open with a JSON object, or only calls: the
    # parser reads an answer that starts with `{` as calls separated by `;`.
    more = '("; " call)*' if parallel else ""
    return "\n".join(
        [
            f"start: TEXT | call {more}" if allow_text else f"start: call {more}",
            r"TEXT: /(?s:.*)/ & ~/(?s:\s*\{.*)/ & ~/(?s:.*<\|python_tag\|>.*)/",
            f"call: {call_json}",
        ]
    )
