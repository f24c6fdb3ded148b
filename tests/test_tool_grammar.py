"""The grammar for `tool_choice: auto` with strict tools or `parallel_tool_calls: false`: text,
or calls in the parser's format whose arguments follow their schema, checked token by token
on the default model's tokenizer."""

from __future__ import annotations

import pytest

from forklift.server.tools import tool_request
from forklift.structured.grammar import GrammarCompiler
from forklift.tokenizer import Tokenizer

CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "weather", "parameters": CITY, "strict": True}},
    {"type": "function", "function": {"name": "noon", "parameters": {"type": "object"}}},
]
WEATHER_CALL = '<tool_call>\n{"name":"weather","arguments":{"city":"Paris"}}\n</tool_call>'
NOON_CALL = '<tool_call>\n{"name":"noon","arguments":{"any":[1,2]}}\n</tool_call>'


@pytest.fixture(scope="module")
def compiler(default_source):
    tokenizer = Tokenizer.from_gguf(default_source.gguf_reader())
    return GrammarCompiler(tokenizer, tokenizer.vocab_size), tokenizer


def allows(compiler, parser: str, parallel: bool, text: str) -> bool:
    """Whether the grammar accepts all of `text` and may end right after it."""
    grammar_compiler, tokenizer = compiler
    constraint = tool_request(TOOLS, "auto", parallel).constraint(parser)
    assert constraint is not None and constraint.grammar is not None
    matcher = grammar_compiler.compile(constraint).deep_copy()
    ids = tokenizer.encode(text, add_special_tokens=False)
    return matcher.consume_tokens(ids) and matcher.is_accepting()


@pytest.mark.parametrize("parallel", [True, False])
def test_hermes_text_or_schema_held_calls(compiler, parallel):
    assert allows(compiler, "hermes", parallel, "It is sunny, no call needed.")
    assert allows(compiler, "hermes", parallel, "Let me look.\n" + WEATHER_CALL)
    assert allows(compiler, "hermes", parallel, NOON_CALL)  # not strict: still an object
    two = WEATHER_CALL + "\n" + NOON_CALL
    assert allows(compiler, "hermes", parallel, two) is parallel
    # A strict tool's arguments follow its schema: no unknown key, no overlong string.
    assert not allows(compiler, "hermes", parallel, WEATHER_CALL.replace("city", "town"))
    too_long = WEATHER_CALL.replace("Paris", "Llanfairpwllgwyngyll")
    assert not allows(compiler, "hermes", parallel, too_long)
    # A call of a function that is not among the tools, and a half-written call, are neither.
    assert not allows(compiler, "hermes", parallel, WEATHER_CALL.replace("weather", "time"))
    assert not allows(compiler, "hermes", parallel, "Sure <tool_call> later")
    assert not allows(compiler, "hermes", parallel, WEATHER_CALL + " and text after")


@pytest.mark.parametrize("parallel", [True, False])
def test_llama3_json_text_or_calls(compiler, parallel):
    call = '{"name":"weather","parameters":{"city":"Oslo"}}'
    assert allows(compiler, "llama3_json", parallel, "Oslo is cold today.")
    assert allows(compiler, "llama3_json", parallel, call)
    assert allows(compiler, "llama3_json", parallel, call + "; " + call) is parallel
    assert not allows(compiler, "llama3_json", parallel, call.replace("city", "town"))
    assert not allows(compiler, "llama3_json", parallel, ' {"not": "a call"}')


def test_auto_without_strict_or_single_call_is_unconstrained():
    loose = [{"type": "function", "function": {"name": "noon", "parameters": {"type": "object"}}}]
    assert tool_request(loose, "auto").constraint("hermes") is None
    assert tool_request(loose, None, True).constraint("hermes") is None
    assert tool_request(loose, None, False).constraint("hermes") is not None
    assert tool_request(TOOLS, None).constraint("hermes") is not None


def test_required_without_parallel_calls_is_one_item():
    constraint = tool_request(TOOLS, "required", False).constraint("hermes")
    assert constraint is not None and constraint.schema()["maxItems"] == 1
    many = tool_request(TOOLS, "required").constraint("hermes")
    assert many is not None and "maxItems" not in many.schema()
