"""Tool-call parsers, the streamed form of their output, and tools in the prompt."""

from __future__ import annotations

import json

import pytest

from forklift.server.errors import APIError
from forklift.server.tools.assistant_message import ToolCallStreamer, final_message
from forklift.server.tools.parsers import HermesParser, Llama3JsonParser, make_parser
from forklift.server.tools.prompt import prepare_conversation
from forklift.server.tools.tool_choice import tool_request

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
        },
    },
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}},
]


def test_hermes_finds_every_call_and_keeps_the_text():
    text = (
        'Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>\n'
        '<tool_call>{"name": "now", "arguments": {}}</tool_call>'
    )
    parsed = HermesParser().parse(text)
    assert parsed.content == "Sure."
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("add", {"a": 1}),
        ("now", {}),
    ]
    assert len({c.id for c in parsed.tool_calls}) == 2


def test_hermes_leaves_broken_calls_as_text():
    text = "<tool_call>not json</tool_call> done"
    parsed = HermesParser().parse(text)
    assert parsed.tool_calls == [] and parsed.content == text


def test_llama3_json_calls_with_and_without_the_python_tag():
    parser = Llama3JsonParser(frozenset({"add", "now"}))
    one = parser.parse('{"name": "add", "parameters": {"a": 2}}')
    assert [(c.name, c.arguments) for c in one.tool_calls] == [("add", '{"a": 2}')]
    two = parser.parse(
        '<|python_tag|>{"name": "add", "parameters": {"a": "x;y"}}; '
        '{"name": "now", "parameters": {}}'
    )
    assert [c.name for c in two.tool_calls] == ["add", "now"]
    assert json.loads(two.tool_calls[0].arguments) == {"a": "x;y"}
    plain = parser.parse("The answer is {not a call}")
    assert plain.tool_calls == [] and plain.content == "The answer is {not a call}"


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "Tom", "age": 3}',  # JSON the user asked for, not a call
        '{"name": "add"}',  # no parameters: not a call in this format
        '{"name": "unknown", "parameters": {}}',  # not one of the tools
    ],
)
def test_llama3_json_leaves_json_that_is_no_call_as_content(text):
    parsed = Llama3JsonParser(frozenset({"add", "now"})).parse(text)
    assert parsed.tool_calls == [] and parsed.content == text


def test_hermes_ignores_calls_of_unknown_functions():
    text = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
    parsed = HermesParser(frozenset({"add"})).parse(text)
    assert parsed.tool_calls == [] and parsed.content == text


@pytest.mark.parametrize("name", ["hermes", "llama3_json"])
def test_streamed_deltas_rebuild_the_final_message(name):
    parser = make_parser(name)
    call = (
        '<tool_call>{"name": "add", "arguments": {"a": 5}}</tool_call>'
        if name == "hermes"
        else '{"name": "add", "parameters": {"a": 5}}'
    )
    # Text around the call (hermes) or only whitespace before it (llama3_json).
    text = "I will add. " + call + " Done." if name == "hermes" else "\n\n" + call
    tools = tool_request(TOOLS, "auto")
    parser = make_parser(name, tools.names)
    streamer = ToolCallStreamer(tools, parser)
    deltas = []
    for end in range(1, len(text) + 1):  # one character per step, the worst case
        deltas += streamer.deltas(text[:end], finished=end == len(text))
    content = "".join(d.get("content", "") for d in deltas)
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    message, finish = final_message(text, "stop", tools, parser)
    assert "<tool" not in content and "{" not in content
    assert content == ("I will add.  Done." if name == "hermes" else "")
    assert message["content"] == (content or None)
    assert [c["function"] for c in calls] == [
        {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
        for c in message["tool_calls"]
    ]
    assert finish == "tool_calls"


def test_plain_text_streams_as_content_under_auto():
    tools = tool_request(TOOLS, "auto")
    streamer = ToolCallStreamer(tools, HermesParser())
    text = "No tools needed <tool is a word"
    out = []
    for end in range(1, len(text) + 1):
        out += streamer.deltas(text[:end], finished=end == len(text))
    assert "".join(d["content"] for d in out) == text
    assert final_message(text, "stop", tools, HermesParser()) == (
        {"role": "assistant", "content": text},
        "stop",
    )


def test_a_call_cut_by_the_length_limit_keeps_finish_reason_length():
    tools = tool_request(TOOLS, {"type": "function", "function": {"name": "add"}})
    message, finish = final_message('{"a": 1', "length", tools, HermesParser())
    assert finish == "length" and message["tool_calls"][0]["function"]["arguments"] == '{"a": 1'


def test_tools_without_a_template_that_knows_them_become_instructions():
    template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    tools = tool_request(TOOLS, "auto")
    history = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "1 + 1?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"function": {"name": "add", "arguments": '{"a": 1}'}}],
        },
        {"role": "tool", "content": "2"},
    ]
    messages, template_tools = prepare_conversation(history, tools, template, "hermes")
    assert template_tools is None
    assert (
        messages[0]["content"].startswith("Be brief.") and '"name": "add"' in messages[0]["content"]
    )
    assert (
        "<tool_call>" in messages[2]["content"]
        and '"arguments": {"a": 1}' in messages[2]["content"]
    )
    knowing = "{{ tools | tojson }}{% for m in messages %}{{ m.content }}{% endfor %}"
    same, passed = prepare_conversation(history, tools, knowing, "hermes")
    assert [m["role"] for m in same] == [m["role"] for m in history] and passed == TOOLS


def test_tool_choice_none_adds_no_instructions():
    messages, _ = prepare_conversation(
        [{"role": "user", "content": "hi"}], tool_request(TOOLS, "none"), "{{ x }}", "hermes"
    )
    assert messages == [{"role": "user", "content": "hi"}]


def test_required_streams_unparsable_output_as_content():
    tools = tool_request(TOOLS, "required")
    streamer = ToolCallStreamer(tools, HermesParser())
    assert streamer.deltas('<tool_call>\n{"name": "add", "argu', finished=False) == []
    cut = '<tool_call>\n{"name": "add", "arguments": {"a"'
    assert streamer.deltas(cut, finished=True) == [{"content": cut}]
    assert final_message(cut, "length", tools, HermesParser()) == (
        {"role": "assistant", "content": cut},
        "length",
    )


def test_required_moves_the_tools_definitions_to_the_root():
    unit = {"enum": ["c", "f"]}
    tools = [
        {
            "type": "function",
            "function": {
                "name": name,
                "parameters": {
                    "$defs": {"Unit": unit},
                    "type": "object",
                    "properties": {"u": {"$ref": "#/$defs/Unit"}},
                },
            },
        }
        for name in ("a", "b")
    ]
    grammar = tool_request(tools, "required").constraint("hermes").grammar
    schema = json.loads(grammar.split("%json ", 1)[1].splitlines()[0])
    assert schema["$defs"] == {"Unit": unit}
    assert all("$defs" not in branch["properties"]["arguments"]
               for branch in schema["anyOf"])  # fmt: skip
    tools[1]["function"]["parameters"]["$defs"] = {"Unit": {"enum": ["k"]}}
    with pytest.raises(APIError, match="differently"):
        tool_request(tools, "required").constraint("hermes")


def test_tool_aware_templates_get_arguments_as_objects():
    history = [
        {"role": "user", "content": "1 + 1?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"function": {"name": "add", "arguments": '{"a": 1}'}}],
        },
    ]
    knowing = "{{ tools | tojson }}{% for m in messages %}{{ m.content }}{% endfor %}"
    messages, _ = prepare_conversation(history, tool_request(TOOLS, "auto"), knowing, "hermes")
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert history[1]["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'  # not mutated


@pytest.mark.parametrize(
    "message, param",
    [
        ({"role": "assistant", "tool_calls": 5}, "messages[0].tool_calls"),
        ({"role": "assistant", "tool_calls": [{"function": "x"}]}, "messages[0].tool_calls[0]"),
        ({"role": "tool", "content": [{"type": "text", "text": 5}]}, "messages[0].content"),
    ],
)
def test_malformed_tool_messages_are_a_400(message, param):
    with pytest.raises(APIError) as caught:
        prepare_conversation([message], None, "{{ messages }}", "hermes")
    assert caught.value.status == 400 and caught.value.param == param


def test_duplicate_tool_names_are_refused():
    with pytest.raises(APIError, match="twice"):
        tool_request([TOOLS[0], TOOLS[0]], "auto")
