"""The grammar for `tool_choice: auto` with strict tools or `parallel_tool_calls: false`: text,
or calls in the parser's format whose arguments follow their schema, checked token by token
on the default model's tokenizer."""

from __future__ import annotations

import pytest

from forklift.server.errors import APIError
from forklift.server.tools.tool_choice import closed_schema, tool_request
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


def allows_required(compiler, parallel: bool, text: str) -> bool:
    grammar_compiler, tokenizer = compiler
    constraint = tool_request(TOOLS, "required", parallel).constraint("hermes")
    matcher = grammar_compiler.compile(constraint).deep_copy()
    ids = tokenizer.encode(text, add_special_tokens=False)
    return matcher.consume_tokens(ids) and matcher.is_accepting()


@pytest.mark.parametrize("parallel", [True, False])
def test_required_is_calls_only_one_without_parallel_calls(compiler, parallel):
    assert allows_required(compiler, parallel, WEATHER_CALL)
    assert allows_required(compiler, parallel, WEATHER_CALL + "\n" + NOON_CALL) is parallel
    assert not allows_required(compiler, parallel, "No call today.")
    assert not allows_required(compiler, parallel, "Sure.\n" + WEATHER_CALL)


def test_arguments_hold_only_the_declared_parameters(compiler):
    open_city = {"type": "object", "properties": {"city": {"type": "string"}}}
    tools = [{"type": "function", "function": {"name": "weather", "parameters": open_city}}]
    grammar_compiler, tokenizer = compiler
    named = tool_request(tools, {"type": "function", "function": {"name": "weather"}})
    matcher = grammar_compiler.compile(named.constraint("hermes")).deep_copy()
    extra = tokenizer.encode('{"city":"Rome","weather":{"temp":1}}', add_special_tokens=False)
    assert not matcher.consume_tokens(extra)
    matcher = grammar_compiler.compile(named.constraint("hermes")).deep_copy()
    assert matcher.consume_tokens(tokenizer.encode('{"city":"Rome"}', add_special_tokens=False))
    assert matcher.is_accepting()


def test_closed_schema_keeps_what_the_schema_says():
    schema = {
        "type": "object",
        "properties": {
            "where": {"type": "object", "properties": {"city": {"type": "string"}}},
            "tags": {"type": "object", "additionalProperties": {"type": "integer"}},
            "free": {"type": "object"},
            "fixed": {"const": {"properties": {"a": 1}}},
        },
    }
    closed = closed_schema(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["where"]["additionalProperties"] is False
    assert closed["properties"]["tags"]["additionalProperties"] == {"type": "integer"}
    assert "additionalProperties" not in closed["properties"]["free"]
    assert closed["properties"]["fixed"] == {"const": {"properties": {"a": 1}}}
    assert "additionalProperties" not in schema  # the request's own schema is untouched


def test_closed_schema_leaves_composed_and_referring_objects_alone():
    both = {"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]}
    assert closed_schema(both) == both  # closing a branch would forbid the other's key
    union = {"properties": {"kind": {}}, "oneOf": [{"properties": {"x": {}}}]}
    assert closed_schema(union) == union
    beyond = {"properties": {"a": {}}, "required": ["a", "b"]}
    assert closed_schema(beyond) == beyond  # b must be allowed although not listed
    named = {"type": "object", "properties": {"properties": {"type": "object"}}}
    closed = closed_schema(named)
    assert closed["additionalProperties"] is False
    # A property named "properties" is a name, not a keyword: its own schema is unlisted.
    assert closed["properties"]["properties"] == {"type": "object"}
    refers = {"$defs": {"P": {"properties": {"x": {}}}}, "$ref": "#/$defs/P"}
    assert closed_schema(refers)["$defs"]["P"]["additionalProperties"] is False
    assert "additionalProperties" not in closed_schema(refers)


def test_auto_with_strict_tools_answers_in_the_response_format(compiler):
    from forklift.structured.params import StructuredOutputsParams

    grammar_compiler, tokenizer = compiler
    answer = StructuredOutputsParams(json=CITY, param="response_format")
    constraint = tool_request(TOOLS, "auto").constraint("hermes", answer)
    for text, allowed in [
        ('{"city":"Rome"}', True),
        ("Rome is nice.", False),
        ('{"town":"Rome"}', False),
        (WEATHER_CALL, True),
    ]:
        matcher = grammar_compiler.compile(constraint).deep_copy()
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert (matcher.consume_tokens(ids) and matcher.is_accepting()) is allowed, text
    with pytest.raises(APIError, match="forces a call"):
        tool_request(TOOLS, "required").constraint("hermes", answer)
    regex = StructuredOutputsParams(regex="a+", param="structured_outputs")
    with pytest.raises(APIError, match="JSON schema"):
        tool_request(TOOLS, "auto").constraint("hermes", regex)
    # Plain auto leaves the answer's constraint to the request, as before.
    loose = [{"type": "function", "function": {"name": "noon", "parameters": {"type": "object"}}}]
    assert tool_request(loose, "auto").constraint("hermes", answer) is None
