"""Structured outputs and tool calls through the server, driven by the official openai client
on a tiny random model (it never writes JSON or calls a tool by itself)."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import httpx
import jsonschema
import openai
import pytest
from server_harness import running_server
from tiny_models import make_tiny_byte_level_model

from forklift.config import EngineConfig
from forklift.engine.engine import LLMEngine
from forklift.server.app import build_app
from forklift.server.chat import chat_prompt_ids
from forklift.server.protocol import ChatMessage
from forklift.server.tools import call_grammar
from forklift.server.tools.tool_choice import tool_request
from forklift.tokenizer import Tokenizer

MODEL = "tiny"
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Forecast", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}


@pytest.fixture(scope="module")
def server(default_source, tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-byte-level-server")
    make_tiny_byte_level_model(directory, Tokenizer.from_gguf(default_source.gguf_reader()))
    engine = LLMEngine(
        EngineConfig(model=str(directory), dtype="float32", max_model_len=512, enforce_eager=True)
    )
    app = build_app(engine, MODEL)
    with running_server(app) as url:
        yield SimpleNamespace(url=url, app=app)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def reassemble(stream) -> tuple[str, dict[int, dict[str, str]], str | None]:
    """(content, tool calls by index, finish reason) the way a client rebuilds a stream."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += delta.id or ""
            call["name"] += (delta.function.name or "") if delta.function else ""
            call["arguments"] += (delta.function.arguments or "") if delta.function else ""
        finish = choice.finish_reason or finish
    return content, calls, finish


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_json_schema(client, stream):
    kwargs = dict(
        model=MODEL,
        messages=ASK,
        max_tokens=100,
        seed=1,
        n=2,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "weather", "schema": WEATHER, "strict": True},
        },
    )
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        texts = ["", ""]
        for chunk in chunks:
            for choice in chunk.choices:
                texts[choice.index] += choice.delta.content or ""
    else:
        reply = client.chat.completions.create(**kwargs)
        texts = [c.message.content for c in reply.choices]
        assert all(c.finish_reason == "stop" for c in reply.choices)
    for text in texts:
        jsonschema.validate(json.loads(text), WEATHER)


def test_json_object_and_vllm_fields(client, server):
    reply = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        max_tokens=60,
        response_format={"type": "json_object"},
        extra_body={"structured_outputs": None},
    )
    text = reply.choices[0].message.content
    assert text.startswith("{"), text  # a random model never opens an object by itself
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    completion = client.completions.create(
        model=MODEL,
        prompt="Pick:",
        max_tokens=10,
        extra_body={"structured_outputs": {"choice": ["left", "right"]}},
    )
    assert completion.choices[0].text in ("left", "right")
    for body, check in [
        ({"guided_regex": r"[0-9]{3}-[0-9]{4}"}, lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t)),
        ({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
        ({"guided_json": TIME}, lambda t: jsonschema.validate(json.loads(t), TIME) is None),
        ({"guided_grammar": 'root ::= "A" [0-9] [0-9]'}, lambda t: re.fullmatch(r"A\d\d", t)),
    ]:
        text = httpx.post(
            server.url + "/v1/completions",
            json={"prompt": "Answer:", "max_tokens": 40, **body},
            timeout=60,
        ).json()["choices"][0]["text"]
        assert check(text), (body, text)


@pytest.mark.parametrize("stream", [False, True])
def test_named_function_call_parses_into_its_schema(client, stream):
    kwargs = dict(
        model=MODEL,
        messages=ASK,
        max_tokens=100,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    if stream:
        content, calls, finish = reassemble(client.chat.completions.create(stream=True, **kwargs))
        assert content == ""
        (call,) = calls.values()
        name, arguments, call_id = call["name"], call["arguments"], call["id"]
    else:
        reply = client.chat.completions.create(**kwargs)
        message, finish = reply.choices[0].message, reply.choices[0].finish_reason
        assert message.content is None
        (tool_call,) = message.tool_calls
        name, arguments, call_id = (
            tool_call.function.name, tool_call.function.arguments, tool_call.id
        )  # fmt: skip
    assert finish == "tool_calls"
    assert name == "get_weather" and call_id.startswith("call_")
    jsonschema.validate(json.loads(arguments), WEATHER)


@pytest.mark.parametrize("stream", [False, True])
def test_required_calls_one_or_more_tools(client, stream):
    kwargs = dict(
        model=MODEL, messages=ASK, max_tokens=200, tools=TOOLS, tool_choice="required", seed=3
    )
    if stream:
        _, by_index, finish = reassemble(client.chat.completions.create(stream=True, **kwargs))
        calls = [(c["name"], c["arguments"]) for c in by_index.values()]
    else:
        reply = client.chat.completions.create(**kwargs)
        finish = reply.choices[0].finish_reason
        calls = [
            (c.function.name, c.function.arguments) for c in reply.choices[0].message.tool_calls
        ]
    assert finish == "tool_calls" and calls
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.parametrize("stream", [False, True])
def test_auto_parses_a_hermes_call_and_keeps_the_text_before_it(client, stream):
    # The tiny model would never call a tool; a regex makes it write one in Hermes format.
    call = r'<tool_call>\{"name": "get_time", "arguments": \{"zone": "(UTC|CET)"\}\}</tool_call>'
    kwargs = dict(
        model=MODEL,
        messages=ASK,
        max_tokens=100,
        tools=TOOLS,
        extra_body={"guided_regex": r"Let me check\. " + call},
    )
    if stream:
        content, by_index, finish = reassemble(
            client.chat.completions.create(stream=True, **kwargs)
        )
        calls = [(c["name"], c["arguments"]) for c in by_index.values()]
    else:
        reply = client.chat.completions.create(**kwargs)
        message, finish = reply.choices[0].message, reply.choices[0].finish_reason
        content = message.content
        calls = [(c.function.name, c.function.arguments) for c in message.tool_calls]
    assert content.strip() == "Let me check."
    assert finish == "tool_calls"
    ((name, arguments),) = calls
    assert name == "get_time" and json.loads(arguments)["zone"] in ("UTC", "CET")


STRICT_TOOLS = [{**tool, "function": {**tool["function"], "strict": True}} for tool in TOOLS]


def calls_of(reply) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in reply.message.tool_calls or []]


def test_required_with_parallel_tool_calls_false_is_one_call(client):
    reply = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        max_tokens=200,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        n=4,
        seed=3,
    )
    for choice in reply.choices:
        ((name, arguments),) = calls_of(choice)
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.fixture
def calls_only(monkeypatch):
    """Test hook: `auto`'s grammar without its text branch, so the tiny random model (which
    never calls a tool by itself) must write a call; the rest is the server's own."""
    from forklift.server.tools import tool_choice as tools_module

    def without_text(calls, definitions, parser, parallel, allow_text, text_schema=None):
        assert allow_text and text_schema is None
        return call_grammar.tool_call_grammar(calls, definitions, parser, parallel, False)

    monkeypatch.setattr(tools_module, "tool_call_grammar", without_text)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("parallel", [False, None])
def test_strict_tools_with_auto_hold_calls_to_the_schema(client, calls_only, stream, parallel):
    kwargs = dict(model=MODEL, messages=ASK, max_tokens=160, tools=STRICT_TOOLS, seed=5, n=3)
    if parallel is not None:
        kwargs["parallel_tool_calls"] = parallel
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        per_choice = [
            reassemble(c for c in chunks if c.choices and c.choices[0].index == index)
            for index in range(3)
        ]
        results = [
            ([(c["name"], c["arguments"]) for c in by_index.values()], finish)
            for _, by_index, finish in per_choice
        ]
    else:
        reply = client.chat.completions.create(**kwargs)
        results = [(calls_of(c), c.finish_reason) for c in reply.choices]
    for calls, finish in results:
        assert calls and finish == "tool_calls"
        if parallel is False:
            assert len(calls) == 1
        for name, arguments in calls:
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_strict_tools_with_auto_may_answer_in_text(client):
    # The tiny model writes text; the grammar lets it, and nothing in it reads as a call.
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=12, tools=STRICT_TOOLS, parallel_tool_calls=False
    )
    choice = reply.choices[0]
    assert choice.message.tool_calls is None and choice.message.content
    assert "<tool_call>" not in choice.message.content


def test_strict_tools_with_a_response_format_answer_in_it_or_call(client):
    """The Agents SDK's agent with tools and an output_type: strict tools, auto, and a
    json_schema response_format in one request."""
    reply = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        max_tokens=160,
        tools=STRICT_TOOLS,
        response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}},
        n=3,
        seed=11,
    )
    for choice in reply.choices:  # every choice whole: a JSON answer or schema-held calls
        if choice.message.tool_calls:
            for name, arguments in calls_of(choice):
                jsonschema.validate(json.loads(arguments), SCHEMAS[name])
        else:
            jsonschema.validate(json.loads(choice.message.content), WEATHER)


def test_tool_results_round_trip_through_the_template(client, server):
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
    ]
    reply = client.chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, tool_choice="none", max_tokens=5
    )
    assert reply.choices[0].message.tool_calls is None
    # What the model read: the tools, the earlier call and its result, in order.
    tokenizer = server.app.state.ctx.tokenizer
    prompt = tokenizer.decode(
        chat_prompt_ids(
            server.app.state.ctx,
            [ChatMessage(**m) for m in history],
            tools=tool_request(TOOLS, "auto"),
        ),
        skip_special_tokens=False,
    )
    assert '"name": "get_weather"' in prompt
    call = prompt.index('<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}')
    assert call < prompt.index("12:00")
    assert reply.usage.prompt_tokens < len(tokenizer.encode(prompt))  # "none": no tool list


@pytest.mark.parametrize(
    "body, param",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "strin"}},
                }
            },  # noqa: E501
            "response_format",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"structured_outputs": {"regex": r"[^\s\S]"}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"guided_json": {"type": "integer", "minimum": 3, "maximum": 1}}, "guided_json"),
        (
            {"tools": [{"type": "function", "function": {"name": "f"}}]},
            "tools[0].function.parameters",
        ),  # noqa: E501
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),  # noqa: E501
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        (
            {"tools": [{**TOOLS[1], "function": {**TOOLS[1]["function"], "strict": "yes"}}]},
            "tools[0].function.strict",
        ),
        ({"tools": TOOLS, "parallel_tool_calls": 5}, "parallel_tool_calls"),
        ({"tools": TOOLS, "tool_choice": "required", "guided_choice": ["a"]}, "guided_choice"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": ["f"]}}},
            "tool_choice",
        ),  # noqa: E501
        ({"messages": [*ASK, {"role": "assistant", "tool_calls": 5}]}, "messages[1].tool_calls"),
        (
            {"messages": [*ASK, {"role": "assistant", "tool_calls": [{"function": "x"}]}]},
            "messages[1].tool_calls[0]",
        ),
        (
            {"messages": [*ASK, {"role": "tool", "content": [{"type": "text", "text": 5}]}]},
            "messages[1].content",
        ),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}
                ],
                "tool_choice": "required",
            },  # noqa: E501
            "tools",
        ),
    ],
)
def test_bad_constraints_are_a_400_naming_the_field(server, body, param):
    response = httpx.post(
        server.url + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 5, **body}
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error
