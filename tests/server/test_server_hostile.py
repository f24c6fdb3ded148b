"""Hostile request bodies: never a 5xx, every 4xx in OpenAI's error shape, and afterwards
the server still answers and holds no KV block."""

from __future__ import annotations

import json

import httpx
import pytest
from server_harness import serving_default_model, wait_until_idle

M = "smol"
USER = [{"role": "user", "content": "Hi"}]


def _c(**fields):
    return {"model": M, "prompt": "Hi", "max_tokens": 2, **fields}


def _chat(**fields):
    return {"model": M, "messages": USER, "max_tokens": 2, **fields}


CMPL, CHAT = "/v1/completions", "/v1/chat/completions"

# (path, body): raw bytes are sent as they are, anything else as JSON (NaN / Infinity too).
HOSTILE = [
    (CMPL, b"{not json"),
    (CMPL, b""),
    (CMPL, b"[]"),
    (CMPL, b"null"),
    (CMPL, b'"a string"'),
    (CMPL, b'{"prompt": "' + b"\xff\xfe" * 10 + b'"}'),
    (CMPL, {"model": M}),
    (CMPL, _c(prompt={})),
    (CMPL, _c(prompt=[])),
    (CMPL, _c(prompt=[[]])),
    (CMPL, _c(prompt=[[[1]]])),
    (CMPL, _c(prompt=[-1])),
    (CMPL, _c(prompt=[10**30])),
    (CMPL, _c(prompt=[1.5])),
    (CMPL, _c(prompt=[True, False])),
    (CMPL, _c(prompt=["Hi", [1, 2]])),
    (CMPL, _c(prompt="Hi " * 5000)),
    (CMPL, _c(n=-1)),
    (CMPL, _c(n="lots")),
    (CMPL, _c(n=1e10)),
    (CMPL, _c(n=10**6)),
    (CMPL, _c(best_of=10**6)),
    (CMPL, _c(max_tokens=-1)),
    (CMPL, _c(max_tokens=2**70)),
    (CMPL, _c(max_tokens=10**9)),
    (CMPL, _c(temperature=float("nan"))),
    (CMPL, _c(temperature=float("inf"))),
    (CMPL, _c(temperature=1e308)),
    (CMPL, _c(top_p=float("nan"))),
    (CMPL, _c(top_k=10**9)),
    (CMPL, _c(top_k=-5)),
    (CMPL, _c(top_k=2**70)),
    (CMPL, _c(min_p=float("nan"))),
    (CMPL, _c(presence_penalty=float("nan"))),
    (CMPL, _c(frequency_penalty=float("-inf"))),
    (CMPL, _c(repetition_penalty=float("inf"))),
    (CMPL, _c(repetition_penalty=float("nan"))),
    (CMPL, _c(seed=-1)),
    (CMPL, _c(seed=2**70)),
    (CMPL, _c(logprobs=-1)),
    (CMPL, _c(logprobs=10**6)),
    (CMPL, _c(min_tokens=10**9, max_tokens=None)),
    (CMPL, _c(stop=[""])),
    (CMPL, _c(stop=5)),
    (CMPL, _c(stop=["x"] * 10**4)),
    (CMPL, _c(stop_token_ids=[-1])),
    (CMPL, _c(stop_token_ids=[10**12])),
    (CMPL, _c(stop_token_ids=list(range(10**4)))),
    (CMPL, _c(logit_bias={str(i): 100 for i in range(10**4)})),
    (CMPL, _c(logit_bias="x")),
    (CMPL, _c(logprobs_mode="cooked")),
    (CMPL, _c(cache_salt=5)),
    (CMPL, _c(model=123)),
    (CMPL, _c(stream="yes")),
    (CMPL, _c(stream_options=5)),
    (CMPL, _c(suffix="tail")),
    (CMPL, _c(echo=True, prompt=[1, 2, 3], logprobs=2)),
    (CMPL, _c(prompt=["Hi"] * 10**4)),
    (CHAT, {"model": M}),
    (CHAT, _chat(messages="hi")),
    (CHAT, _chat(messages=[])),
    (CHAT, _chat(messages=[{"role": 5}])),
    (CHAT, _chat(messages=[{"content": "x"}])),
    (CHAT, _chat(messages=[{"role": "user", "content": None}])),
    (CHAT, _chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}])),
    (CHAT, _chat(messages=[{"role": "user", "content": [5, None]}])),
    (CHAT, _chat(messages=[{"role": "user", "content": {"a": 1}}])),
    (CHAT, _chat(messages=USER * 2000)),
    (CHAT, _chat(chat_template_kwargs={"messages": 5})),
    (CHAT, _chat(chat_template_kwargs={"add_generation_prompt": "no"})),
    (CHAT, _chat(chat_template_kwargs={"tools": 5})),
    (CHAT, _chat(chat_template_kwargs=[1])),
    (CHAT, _chat(logprobs=True, top_logprobs=10**6)),
    (CHAT, _chat(top_logprobs=3)),
    (CHAT, _chat(max_completion_tokens=-5)),
    (CHAT, _chat(n=10**6, stream=True)),
    (CMPL, _c(n=10**6, stream=True)),
    ("/tokenize", {"prompt": 5}),
    ("/tokenize", {"messages": [{"role": "user", "content": [5]}]}),
    ("/tokenize", {}),
    ("/detokenize", {"tokens": [-1]}),
    ("/detokenize", {"tokens": [10**30]}),
]


@pytest.fixture(scope="module")
def server(default_source):
    # Room for every valid body here; a small context also bounds the one that runs to it
    # (min_tokens 10**9 with no max_tokens).
    context = dict(max_model_len=64, kv_cache_memory_bytes=16 * 2**20, max_num_batched_tokens=64)
    with serving_default_model(default_source, M, **context) as (url, engine, _):
        yield url, engine


def _send(url: str, body: object) -> httpx.Response:
    if isinstance(body, bytes):
        headers = {"content-type": "application/json"}
        return httpx.post(url, content=body, headers=headers, timeout=60)
    return httpx.post(url, content=json.dumps(body).encode(), timeout=60,
                      headers={"content-type": "application/json"})  # fmt: skip


def test_hostile_bodies_get_4xx_in_openais_shape_and_leave_the_server_whole(server):
    url, engine = server
    failures = []
    for path, body in HOSTILE:
        response = _send(url + path, body)
        shown = repr(body)[:80]
        if response.status_code >= 500:
            failures.append(f"{path} {shown}: {response.status_code} {response.text[:200]}")
        elif response.status_code >= 400:
            error = response.json().get("error", {})
            if set(error) != {"message", "type", "param", "code"} or not error["message"]:
                failures.append(f"{path} {shown}: bad error shape {response.text[:200]}")
    assert not failures, "\n".join(failures)
    ok = httpx.post(url + CMPL, json=_c(), timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    wait_until_idle(engine)
    assert engine.num_free_blocks == engine.num_usable_blocks
