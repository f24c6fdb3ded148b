"""POST /v1/responses on the default model, driven by the official openai client."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from server_harness import serving_default_model, wait_until_idle

from forklift.server.responses.events import StreamedOutput
from forklift.server.responses.store import ResponseStore, StoredResponse

MODEL = "smol"
QUESTION = "What is the capital of France?"
INSTRUCTIONS = "Answer in one short sentence."
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": CITY,
}
NAMED_CHOICE = {"type": "function", "name": "get_weather"}
TEXT_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


@pytest.fixture(scope="module")
def server(default_source):
    with serving_default_model(default_source, MODEL) as (url, _, app):
        yield url, app


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)


def prompt_tokens(url: str, messages: list[dict]) -> int:
    reply = httpx.post(url + "/tokenize", json={"messages": messages})
    assert reply.status_code == 200, reply.text
    return reply.json()["count"]


def collapse(types: list[str]) -> list[str]:
    """Event types with runs of the same type (the deltas) collapsed to one."""
    return [t for i, t in enumerate(types) if i == 0 or types[i - 1] != t]


@pytest.mark.parametrize(("limit", "finish"), [(5, "length"), (16, "stop")])
def test_text_equals_chat_and_status_follows_max_output_tokens(client, limit, finish):
    response = client.responses.create(
        model=MODEL,
        input=QUESTION,
        instructions=INSTRUCTIONS,
        max_output_tokens=limit,
        temperature=0,
        metadata={"case": "plain"},
    )
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": INSTRUCTIONS},
            {"role": "user", "content": QUESTION},
        ],
        max_completion_tokens=limit,
        temperature=0,
    )
    assert chat.choices[0].finish_reason == finish
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.output_text == chat.choices[0].message.content
    (item,) = response.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert item.content[0].type == "output_text" and item.content[0].annotations == []
    if finish == "length":
        assert response.status == item.status == "incomplete"
        assert response.incomplete_details.reason == "max_output_tokens"
    else:
        assert response.status == item.status == "completed"
        assert response.incomplete_details is None and "Paris" in response.output_text
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.usage.total_tokens == chat.usage.total_tokens
    assert response.instructions == INSTRUCTIONS and response.max_output_tokens == limit
    assert response.temperature == 0 and response.metadata == {"case": "plain"}
    assert response.model == MODEL and response.store is True and response.error is None


def test_streamed_events_build_the_same_text(client, server):
    kwargs = dict(model=MODEL, input=QUESTION, max_output_tokens=6, temperature=0)
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(**kwargs, stream=True))
    types = [e.type for e in events]
    assert collapse(types) == [*TEXT_EVENTS, "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text == final.output_text == whole.output_text
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == text and done.item_id == final.output[0].id
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert final.status == "incomplete" and final.usage.output_tokens == 6
    # On the wire each event is named on its `event:` line as in its data.
    with httpx.stream("POST", server[0] + "/v1/responses", json={**kwargs, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines[0::2]]
    datas = [json.loads(line.removeprefix("data: ")) for line in lines[1::2]]
    assert names == [d["type"] for d in datas] == types


def test_text_format_json_schema_is_followed(client):
    response = client.responses.create(
        model=MODEL,
        input="Name a city in France as JSON.",
        max_output_tokens=32,
        temperature=0,
        text={"format": {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}},
    )
    assert response.status == "completed" and response.incomplete_details is None
    jsonschema.validate(json.loads(response.output_text), CITY)
    assert response.text.format.type == "json_schema"


# A call forced to get_weather, as the two function-call tests make it.
WEATHER_CALL = dict(
    model=MODEL,
    input="What is the weather in Paris?",
    tools=[WEATHER_TOOL],
    tool_choice=NAMED_CHOICE,
    max_output_tokens=24,
    temperature=0,
)


def test_named_function_call_then_its_result(client, server):
    call_response = client.responses.create(**WEATHER_CALL)
    assert call_response.status == "completed"
    (call,) = call_response.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), CITY)
    follow_up = client.responses.create(
        model=MODEL,
        previous_response_id=call_response.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "21 C"}],
        max_output_tokens=6,
        temperature=0,
    )
    assert follow_up.output[0].type == "message" and follow_up.output_text
    assert follow_up.previous_response_id == call_response.id
    conversation = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": call.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "21 C"},
    ]
    assert follow_up.usage.input_tokens == prompt_tokens(server[0], conversation)


STRICT_WEATHER_TOOL = {**WEATHER_TOOL, "strict": True}


def test_strict_tool_round_trip_without_tool_choice(client):
    """As the OpenAI Agents SDK runs a tool: strict tools, a forced first turn, then the
    result sent back with the same tools and no tool_choice (auto)."""
    first = client.responses.create(
        **{
            **WEATHER_CALL,
            "tools": [STRICT_WEATHER_TOOL],
            "tool_choice": "required",
            "max_output_tokens": 60,
        },
        parallel_tool_calls=False,
    )
    (call,) = first.output
    assert call.type == "function_call"
    jsonschema.validate(json.loads(call.arguments), CITY)
    second = client.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "21 C"}],
        tools=[STRICT_WEATHER_TOOL],
        parallel_tool_calls=False,
        max_output_tokens=40,
        temperature=0,
    )
    assert second.status in ("completed", "incomplete") and second.output
    calls = [item for item in second.output if item.type == "function_call"]
    assert len(calls) <= 1 and second.parallel_tool_calls is False
    for item in calls:
        jsonschema.validate(json.loads(item.arguments), CITY)
    if not calls:
        assert second.output_text and "<tool_call>" not in second.output_text


def test_streamed_function_call(client):
    events = list(
        client.responses.create(
            **WEATHER_CALL,
            stream=True,
        )
    )
    assert collapse([e.type for e in events]) == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    (item,) = events[-1].response.output
    assert deltas == done.arguments == item.arguments and item.name == "get_weather"
    jsonschema.validate(json.loads(item.arguments), CITY)


def test_previous_response_id_continues_the_conversation(client, server):
    first = client.responses.create(
        model=MODEL,
        input="My name is Ada.",
        instructions=INSTRUCTIONS,
        max_output_tokens=6,
        temperature=0,
    )
    second = client.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "What is my name?"}]}],
        max_output_tokens=4,
        temperature=0,
    )
    # The earlier turn and its answer come first; its instructions are not carried over.
    conversation = [
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"},
    ]
    assert second.usage.input_tokens == prompt_tokens(server[0], conversation)
    assert second.usage.input_tokens > first.usage.output_tokens + prompt_tokens(
        server[0], conversation[-1:]
    )
    assert second.instructions is None and second.previous_response_id == first.id


def test_input_items_with_earlier_calls_render_as_chat_messages(client, server):
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather"}
    response = client.responses.create(
        model=MODEL,
        input=[
            {"role": "developer", "content": "Be brief."},
            {"type": "message", "role": "user", "content": "Weather in Paris?"},
            {**call, "arguments": '{"city": "Paris"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "21 C"},
        ],
        max_output_tokens=1,
    )
    tool_call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [tool_call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
    ]
    assert response.usage.input_tokens == prompt_tokens(server[0], conversation)


def test_unknown_previous_response_id_is_404(client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(model=MODEL, input="Hi", previous_response_id="resp_nope")
    assert caught.value.status_code == 404
    assert caught.value.body["param"] == "previous_response_id"


def test_get_and_delete_a_stored_response(client, server):
    created = client.responses.create(model=MODEL, input="Hi", max_output_tokens=3)
    fetched = client.responses.retrieve(created.id)
    assert fetched.id == created.id and fetched.output_text == created.output_text
    assert fetched.usage.output_tokens == created.usage.output_tokens
    again = httpx.get(f"{server[0]}/v1/responses/{created.id}", params={"stream": "true"})
    assert again.status_code == 400 and again.json()["error"]["param"] == "stream"
    client.responses.delete(created.id)
    for call in (client.responses.retrieve, client.responses.delete):
        with pytest.raises(openai.NotFoundError):
            call(created.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="Hi again", previous_response_id=created.id)
    unstored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_a_client_that_leaves_mid_stream_aborts_and_stores_nothing(server):
    url, app = server
    engine = app.state.ctx.async_engine.engine
    # Some 120 tokens, over ten seconds on two cores, when left to finish.
    body = {"input": "Count from 1 to 500, separated by commas.", "stream": True}
    with httpx.stream("POST", url + "/v1/responses", json=body, timeout=60) as r:
        received = []
        for line in r.iter_lines():
            received.append(line)
            if line == "event: response.output_text.delta":
                break  # the first token is out: leave
    response_id = json.loads(received[1].removeprefix("data: "))["response"]["id"]
    wait_until_idle(engine, timeout=5)
    assert engine.num_free_blocks == engine.num_usable_blocks
    assert httpx.get(f"{url}/v1/responses/{response_id}").status_code == 404


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "Hi", "reasoning": {"effort": "high"}}, "reasoning"),
        ({"input": "Hi", "background": True}, "background"),
        ({"input": "Hi", "max_tokens": 5}, "max_tokens"),
        ({"input": "Hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"max_output_tokens": 4}, "input"),
        ({"input": 3}, "input"),
        ({"input": "Hi", "truncation": "auto"}, "truncation"),
        ({"input": "Hi", "text": {"verbosity": "low"}}, "text.verbosity"),
        ({"input": "Hi", "text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"input": "Hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        (
            {
                "input": "Hi",
                "tools": [WEATHER_TOOL],
                "tool_choice": {"type": "function", "name": "x"},
            },
            "tool_choice",
        ),
        ({"input": "Hi", "tool_choice": "required"}, "tool_choice"),
        (
            {"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]},
            "input",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": [{"role": "robot", "content": "Hi"}]}, "input[0].role"),
        ({"input": "Hi", "temperature": -1}, "temperature"),
        ({"input": "Hi", "metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ],
)
def test_bad_bodies_are_400s_naming_the_field(server, body, param):
    reply = httpx.post(server[0] + "/v1/responses", json=body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"


def test_openai_client_sees_the_refused_field(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL, input="Hi", reasoning={"effort": "low"})
    assert caught.value.body["param"] == "reasoning"
    assert "reasoning" in caught.value.body["message"]


def test_store_evicts_the_least_recently_used():
    store = ResponseStore(capacity=2)
    for name in ("a", "b"):
        store.put(name, StoredResponse({"id": name}, []))
    assert store.get("a") is not None  # now more recent than b
    store.put("c", StoredResponse({"id": "c"}, []))
    assert store.get("b") is None and store.get("a") is not None and len(store) == 2
    assert store.delete("a") and not store.delete("a") and len(store) == 1


def test_stream_of_text_then_a_whole_call():
    """`tool_choice: auto`: text streams, then the parser hands over a finished call."""
    out = StreamedOutput()
    call = {"index": 0, "id": "call_9", "type": "function"}
    deltas = [
        {"content": "Let me "},
        {"content": "check."},
        {"tool_calls": [{**call, "function": {"name": "f", "arguments": '{"a": 1}'}}]},
    ]
    lines = [line for delta in deltas for line in out.feed(delta)] + out.finish("completed")
    datas = [json.loads(line.split("\ndata: ", 1)[1]) for line in lines]
    assert [d["type"] for d in datas] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    assert [d["sequence_number"] for d in datas] == list(range(len(datas)))
    message, function_call = out.items
    assert message["content"][0]["text"] == "Let me check." and message["status"] == "completed"
    assert function_call["call_id"] == "call_9" and function_call["arguments"] == '{"a": 1}'
    assert [d["output_index"] for d in datas if d["type"].endswith("item.done")] == [0, 1]


def test_whitespace_before_a_call_is_no_message():
    out = StreamedOutput()
    header = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f"}}
    lines = out.feed({"content": "\n"}) + out.feed({"tool_calls": [header]})
    lines += out.feed({"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]})
    lines += out.finish("incomplete")
    assert [item["type"] for item in out.items] == ["function_call"]
    assert out.items[0]["status"] == "incomplete" and out.items[0]["arguments"] == "{}"
    assert not any("output_text" in line for line in lines)
