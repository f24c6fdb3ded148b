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
from dataclasses import dataclass
from typing import Any

# Compact JSON inside calls, as for other constraints: small models given free whitespace
# tend to spend their budget on newlines.
_COMPACT_JSON = {"whitespace_flexible": False}


@dataclass(frozen=True)
class _CallFormat:
    """A parser's call format as grammar pieces: the calls a reply may hold (`calls`, with
    their `rules`), and free text beside them (`text_start`, with `text_rules`)."""

    calls: str
    rules: list[str]
    text_start: str
    text_rules: list[str]


def tool_call_grammar(
    call_schemas: list[dict[str, Any]],
    definitions: dict[str, Any],
    parser: str,
    parallel: bool,
    allow_text: bool,
    text_schema: dict[str, Any] | None = None,
) -> str:
    """A Lark grammar (llguidance's dialect) for calls as `parser` writes them, or with
    `allow_text` (`auto`) an answer instead: any text, or with `text_schema` (the request's
    response_format) a JSON value of that schema."""
    schema: dict[str, Any] = {"anyOf": call_schemas, "x-guidance": _COMPACT_JSON}
    if definitions:
        schema["$defs"] = definitions
    call_json = f"%json {json.dumps(schema, ensure_ascii=False)}"
    if parser == "hermes":
        form = _hermes(call_json, parallel)
    elif parser == "llama3_json":
        form = _llama3_json(call_json, parallel)
    else:
        raise ValueError(f"no tool grammar for the parser {parser!r}")
    if not allow_text:
        return "\n".join([f"start: {form.calls}", *form.rules])
    if text_schema is None:
        return "\n".join([f"start: {form.text_start}", *form.text_rules, *form.rules])
    # The answer is the response_format's JSON, and calls start the reply: free text before
    # a call would make every JSON answer look like its start.
    answer = json.dumps({**text_schema, "x-guidance": _COMPACT_JSON}, ensure_ascii=False)
    return "\n".join([f"start: answer | {form.calls}", *form.rules, f"answer: %json {answer}"])


def _hermes(call_json: str, parallel: bool) -> _CallFormat:
    # `<tool_call>\n{...}\n</tool_call>` blocks, one per line, after optional text. TEXT and
    # LEAD may hold no `<tool_call>` of their own, so where the first call starts is never
    # ambiguous.
    more = '("\\n<tool_call>\\n" call)*' if parallel else ""
    return _CallFormat(
        calls=f'"<tool_call>\\n" call {more}',
        rules=[r'call: arguments "\n</tool_call>"', f"arguments: {call_json}"],
        text_start=f"TEXT | LEAD call {more}",
        text_rules=[
            r"TEXT: /(?s:.*)/ & ~/(?s:.*<tool_call>.*)/",
            r"LEAD: /(?s:.*)<tool_call>\n/ & ~/(?s:.*<tool_call>.*<tool_call>.*)/",
        ],
    )


def _llama3_json(call_json: str, parallel: bool) -> _CallFormat:
    # A reply is either text that does not open with a JSON object, or only calls: the
    # parser reads an answer that starts with `{` as calls separated by `;`.
    more = '("; " call)*' if parallel else ""
    return _CallFormat(
        calls=f"call {more}",
        rules=[f"call: {call_json}"],
        text_start=f"TEXT | call {more}",
        text_rules=[r"TEXT: /(?s:.*)/ & ~/(?s:\s*\{.*)/ & ~/(?s:.*<\|python_tag\|>.*)/"],
    )
