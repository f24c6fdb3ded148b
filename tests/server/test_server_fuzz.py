"""Property-based fuzzing of the generation endpoints from the server's own OpenAPI schema.

Schemathesis turns the request models FastAPI publishes into bodies: from the published
schema as it is, valid ones (positive mode) and ones that break it (negative mode), and from
a copy narrowed to sizes the engine accepts, so that most bodies reach generation. For every
body: never a 5xx, every 4xx in OpenAI's error shape, every 200 a whole answer in strict
JSON; afterwards the server still answers and holds no KV block. The engine's limits are
small, so a generated request is cheap or a 400. Derandomized: the same bodies every run.
"""

from __future__ import annotations

import copy
import json

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.generation import GenerationMode
from server_harness import running_server, wait_until_idle
from tiny_models import VOCAB, make_tiny_model

from forklift.config import EngineConfig
from forklift.engine.engine import LLMEngine
from forklift.server.app import build_app
from forklift.server.limits import ServerLimits

MODEL = "tiny"
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
ERROR_TYPES = {"invalid_request_error", "authentication_error", "not_found_error"}
# The tiny model ships no chat template; this one renders any role and content.
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}w3{% endif %}"
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny")
    make_tiny_model("llama", directory)
    (directory / "chat_template.jinja").write_text(TEMPLATE)
    engine = LLMEngine(
        EngineConfig(
            model=str(directory),
            dtype="float32",
            max_model_len=64,
            kv_cache_memory_bytes=2**20,
            max_num_seqs=4,
            max_n=4,
            max_logprobs=4,
            max_stop_strings=4,
            max_stop_string_chars=32,
            max_stop_token_ids=8,
        )
    )
    limits = ServerLimits(max_body_bytes=2**16, max_prompts_per_request=4, max_logit_bias=8)
    app = build_app(engine, MODEL, limits=limits)
    published = app.openapi()
    schemas = {
        "published": schemathesis.openapi.from_dict(published),
        "focused": schemathesis.openapi.from_dict(focused(published)),
    }
    with running_server(app) as url:
        yield url, engine, schemas


def _int(low: int, high: int) -> dict:
    return {"type": "integer", "minimum": low, "maximum": high}


def _num(low: float, high: float) -> dict:
    return {"type": "number", "minimum": low, "maximum": high}


def _or_null(schema: dict) -> dict:
    return {"anyOf": [schema, {"type": "null"}]}


TOKEN_IDS = {"type": "array", "items": _int(0, VOCAB - 1), "maxItems": 8}
# Narrowed fields, so that most bodies get past validation to the engine; the published
# schema's unbounded values (huge max_tokens, n, token ids) are fuzzed as well.
FOCUSED_FIELDS = {
    "model": _or_null({"const": MODEL}),
    "n": _int(1, 4),
    "temperature": _or_null(_num(0, 2)),
    "top_p": _or_null({"type": "number", "exclusiveMinimum": 0, "maximum": 1}),
    "top_k": _int(0, VOCAB),
    "min_p": _num(0, 1),
    "repetition_penalty": {"type": "number", "exclusiveMinimum": 0, "maximum": 2},
    "presence_penalty": _num(-2, 2),
    "frequency_penalty": _num(-2, 2),
    "seed": _or_null(_int(0, 2**31)),
    "stop": _or_null({"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4}),
    "min_tokens": _int(0, 8),
    "max_tokens": _or_null(_int(1, 64)),
    "max_completion_tokens": _or_null(_int(1, 64)),
    "stop_token_ids": _or_null(TOKEN_IDS),
    "logprobs_mode": {"enum": ["processed", "raw"]},
    "top_logprobs": _or_null(_int(0, 4)),
}
FOCUSED_COMPLETION = {
    "prompt": {
        "anyOf": [
            {"type": "string", "maxLength": 40},
            {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 4},
            {**TOKEN_IDS, "minItems": 1},
            {"type": "array", "items": {**TOKEN_IDS, "minItems": 1}, "maxItems": 4},
        ]
    },
    "logprobs": _or_null(_int(0, 4)),
}
TEXT_PART = {
    "type": "object",
    "properties": {"type": {"const": "text"}, "text": {"type": "string", "maxLength": 20}},
    "required": ["type", "text"],
    "additionalProperties": False,
}
FOCUSED_CHAT = {
    "messages": {
        "type": "array",
        "items": {"$ref": "#/components/schemas/ChatMessage"},
        "minItems": 1,
        "maxItems": 3,
    }
}
FOCUSED_MESSAGE = {
    "role": {"enum": ["system", "user", "assistant"]},
    "content": {
        "anyOf": [
            {"type": "string", "maxLength": 40},
            {"type": "array", "items": TEXT_PART, "maxItems": 3},
        ]
    },
}


def focused(published: dict) -> dict:
    """The published schema with the request fields narrowed to sizes the engine accepts."""
    schema = copy.deepcopy(published)
    models = schema["components"]["schemas"]
    for name, extra in (
        ("CompletionRequest", FOCUSED_COMPLETION),
        ("ChatCompletionRequest", FOCUSED_CHAT),
    ):
        properties = models[name]["properties"]
        for field, narrowed in {**FOCUSED_FIELDS, **extra}.items():
            if field in properties:
                properties[field] = narrowed
        models[name]["additionalProperties"] = False
    models["ChatMessage"]["properties"].update(FOCUSED_MESSAGE)
    models["ChatMessage"]["required"] = ["role", "content"]
    # top_logprobs only with logprobs: true.
    models["ChatCompletionRequest"]["anyOf"] = [
        {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]},
        {"properties": {"top_logprobs": {"type": "null"}}},
    ]
    return schema


def strict_json(text: str) -> object:
    """JSON as clients parse it: NaN and Infinity are not JSON."""
    return json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in {text[:300]}"))


def check_response(status: int, text: str, sent: object) -> None:
    """One generated call's answer: no 5xx, a 4xx in OpenAI's shape, a 200 whole."""
    shown = f"body {sent!r:.300} -> {status} {text[:300]}"
    assert status < 500, shown
    if status >= 400:
        error = strict_json(text)["error"]
        assert set(error) == {"message", "type", "param", "code"}, shown
        assert isinstance(error["message"], str) and error["message"], shown
        assert error["type"] in ERROR_TYPES, shown
        assert error["param"] is None or isinstance(error["param"], str), shown
        # OpenAI's machine-readable code where it has one (an unknown model), else the status.
        assert error["code"] == ("model_not_found" if status == 404 else status), shown
        return
    assert status == 200, shown
    if text.startswith("data: "):  # a stream of server-sent events
        events = text.removesuffix("\n\n").split("\n\n")
        assert events[-1] == "data: [DONE]", shown
        for event in events[:-1]:
            assert event.startswith("data: "), shown
            strict_json(event.removeprefix("data: "))
    else:
        assert strict_json(text)["choices"], shown


def send(client: httpx.Client, url: str, case) -> httpx.Response:
    """The generated request, read to its end (streams too); raw bytes are sent as they are."""
    kwargs = case.as_transport_kwargs(base_url=url)
    content = kwargs["data"] if "data" in kwargs else json.dumps(kwargs["json"]).encode()
    headers = {"content-type": "application/json"}
    return client.request(kwargs["method"], kwargs["url"], content=content, headers=headers)


@pytest.mark.parametrize(
    ("schema_name", "mode", "examples"),
    [
        ("published", GenerationMode.POSITIVE, 30),
        ("published", GenerationMode.NEGATIVE, 30),
        ("focused", GenerationMode.POSITIVE, 40),
    ],
)
@pytest.mark.parametrize("path", [CMPL, CHAT])
def test_generated_bodies_never_get_a_5xx(server, path, schema_name, mode, examples):
    url, engine, schemas = server
    operation = schemas[schema_name][path]["POST"]

    @settings(
        max_examples=examples,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(operation.as_strategy(mode))
    def call(case):
        response = send(client, url, case)
        check_response(response.status_code, response.text, case.body)

    with httpx.Client(timeout=60) as client:
        call()
    check_server_is_whole(url, engine)


def check_server_is_whole(url: str, engine: LLMEngine) -> None:
    """A normal request of each kind still gets text, and the engine holds no KV block."""
    wait_until_idle(engine)
    body = {"model": MODEL, "prompt": "w5 w6", "max_tokens": 3, "ignore_eos": True}
    ok = httpx.post(url + CMPL, json=body, timeout=60)
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "w5"}], "max_tokens": 3}
    ok = httpx.post(url + CHAT, json={**chat, "ignore_eos": True}, timeout=60)
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"]
    wait_until_idle(engine)
    assert engine.num_free_blocks == engine.num_usable_blocks


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("path", "body"),
    [
        (CMPL, {"prompt": "w5 w6", "logprobs": 2}),
        (
            CHAT,
            {"messages": [{"role": "user", "content": "w5"}], "logprobs": True, "top_logprobs": 2},
        ),
    ],
)
def test_logprobs_of_tokens_the_filters_dropped_are_finite_json(server, path, body, stream):
    # min_p=1 keeps only the likeliest token: the others' processed logprob is -inf, which
    # JSON cannot carry (it was a 500, or -Infinity in a stream); it is OpenAI's floor now.
    url, engine, _ = server
    request = {**body, "model": MODEL, "max_tokens": 2, "min_p": 1.0, "stream": stream}
    response = httpx.post(url + path, json=request, timeout=60)
    check_response(response.status_code, response.text, request)
    assert "-9999.0" in response.text
    check_server_is_whole(url, engine)
