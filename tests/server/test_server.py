"""The OpenAI-compatible server on the default model, driven by the official openai client."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_harness import serving_default_model, wait_until_idle

from forklift import SamplingParams

MODEL = "smol"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(default_source):
    with serving_default_model(default_source, MODEL) as served:
        yield served


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)


@pytest.fixture
def async_client(server):
    return openai.AsyncOpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)


def test_chat_non_streaming_matches_offline_greedy(client, server, default_llm_fp32):
    reply = client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=24
    )
    offline = default_llm_fp32.chat(
        QUESTION, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False
    )[0]
    choice = reply.choices[0]
    assert choice.message.content == offline.outputs[0].text
    assert "Paris" in choice.message.content
    assert choice.finish_reason == offline.outputs[0].finish_reason
    assert reply.usage.prompt_tokens == len(offline.prompt_token_ids)
    assert reply.usage.completion_tokens == len(offline.outputs[0].token_ids)
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert reply.object == "chat.completion"


def test_completion_streaming_equals_non_streaming(client, default_llm_fp32):
    kwargs = dict(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=12)
    whole = client.completions.create(**kwargs)
    offline = default_llm_fp32.generate(
        "The capital of France is", SamplingParams(temperature=0, max_tokens=12), use_tqdm=False
    )[0].outputs[0]
    assert whole.choices[0].text == offline.text
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 12
    chunks = list(
        client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    assert all(c.object == "text_completion" for c in chunks)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_completion_prompt_forms_echo_and_logprobs(client, server):
    url = server[0]
    ids = httpx.post(url + "/tokenize", json={"prompt": "Hello there"}).json()["tokens"]
    by_ids = client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=4)
    by_text = client.completions.create(
        model=MODEL, prompt="Hello there", temperature=0, max_tokens=4, echo=True, logprobs=2
    )
    assert by_text.choices[0].text == "Hello there" + by_ids.choices[0].text
    lp = by_text.choices[0].logprobs
    # Echoed, the prompt's tokens come first (the first has no logprob), as OpenAI's do.
    assert len(lp.tokens) == len(lp.token_logprobs) == len(ids) + 4
    assert lp.token_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    many = client.completions.create(
        model=MODEL, prompt=["One", "Two"], n=2, temperature=0.8, seed=3, max_tokens=3
    )
    assert sorted(c.index for c in many.choices) == [0, 1, 2, 3]
    assert many.usage.completion_tokens == 12


def test_chat_streaming_with_n_and_logprobs(client):
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=QUESTION,
            n=2,
            temperature=0.7,
            seed=11,
            max_completion_tokens=10,
            logprobs=True,
            top_logprobs=3,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    texts, finishes = {0: "", 1: ""}, {}
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
            if choice.logprobs and choice.logprobs.content:
                assert all(len(t.top_logprobs) == 3 for t in choice.logprobs.content)
    assert set(finishes) == {0, 1}
    assert all(texts.values())
    usage = chunks[-1].usage
    assert usage.completion_tokens <= 20 and usage.completion_tokens >= 2


def test_async_client_and_sixteen_concurrent_streams_share_the_batch(async_client, server):
    engine = server[1]

    async def one(i: int):
        stream = await async_client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"Count to {i + 3}."}],
            temperature=0.5,
            seed=i,
            max_tokens=16,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        text, usage = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            if chunk.usage:
                usage = chunk.usage
        return text, usage

    async def run_all():
        return await asyncio.gather(*(one(i) for i in range(16)))

    first_step = engine.step_log[-1].index if engine.step_log else 0
    results = asyncio.run(run_all())
    assert len(results) == 16
    for text, usage in results:
        assert text
        assert usage.completion_tokens == 16
    steps = [s for s in engine.step_log if s.index > first_step]
    assert max(len(s.request_ids) for s in steps) >= 8
    # 16 requests x 16 tokens in far fewer steps than one at a time would take.
    assert len(steps) < 16 * 16 / 2


def test_disconnects_abort_requests_and_free_blocks(server):
    url, engine, _ = server
    body = {
        "model": MODEL,
        "messages": QUESTION,
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    for _ in range(3):
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            received = [next(lines) for _ in range(6)]
            assert any(line.startswith("data: ") for line in received)
    # A non-streaming client that gives up before its first token.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            url + "/v1/chat/completions",
            json={**body, "stream": False},
            timeout=httpx.Timeout(5.0, read=0.2),
        )
    wait_until_idle(engine)
    assert engine.num_free_blocks == engine.num_usable_blocks
    assert engine.scheduler.num_running == 0


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "top_p": 5}, 400, "top_p"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
        (
            "/v1/completions",
            {"model": MODEL, "prompt": "hi", "temperature": -1},
            400,
            "temperature",
        ),
        ("/v1/completions", {"model": MODEL, "prompt": "hi " * 600}, 400, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt"),
        ("/v1/completions", {"model": "gpt-4", "prompt": "hi"}, 404, "model"),
        ("/v1/chat/completions", {"model": "gpt-4", "messages": QUESTION}, 404, "model"),
        ("/v1/completions", {"model": MODEL}, 400, "prompt"),
        ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"content": "x"}]}, 400, "messages"),
        ("/v1/chat/completions", {"model": MODEL, "messages": QUESTION, "n": 0}, 400, "n"),
        ("/v1/nothing-here", {}, 404, None),
    ],
)
def test_errors_have_openai_shape_and_the_server_keeps_serving(
    client, server, path, body, status, param
):
    response = httpx.post(server[0] + path, json=body)
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert error["message"]
    ok = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert ok.usage.completion_tokens == 2


def test_logit_bias_and_token_choices_reach_the_sampler(client, server):
    def text_of(ids: list[int]) -> str:
        return httpx.post(server[0] + "/detokenize", json={"tokens": ids}).json()["prompt"]

    base = dict(model=MODEL, messages=QUESTION, max_tokens=4, temperature=0)
    forced = client.chat.completions.create(**base, logit_bias={"42": 100})
    assert forced.choices[0].message.content == text_of([42] * 4)
    banned = client.chat.completions.create(**base, logit_bias={"42": -100, "43": -100})
    plain = client.chat.completions.create(**base)
    assert banned.choices[0].message.content == plain.choices[0].message.content  # not its top
    only = client.completions.create(
        model=MODEL, prompt="Hi", max_tokens=3, temperature=1.0,
        extra_body={"allowed_token_ids": [43]},
    )  # fmt: skip
    assert only.choices[0].text == text_of([43] * 3)
    for bad in ({"logit_bias": {"not-a-token": 1}}, {"logit_bias": {"5": 500}},
                {"allowed_token_ids": []}, {"bad_words": [""]}):  # fmt: skip
        response = httpx.post(server[0] + "/v1/chat/completions", json={**base, **bad})
        assert response.status_code == 400
        assert response.json()["error"]["param"] == next(iter(bad))


def test_echo_with_logprobs_scores_the_prompt_too(client, server):
    engine = server[1]
    prompt = "The capital of France is"
    ids = engine.tokenizer.encode(prompt, add_special_tokens=False)
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0,
                                      logprobs=2)  # fmt: skip
    echoed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0,
                                       logprobs=2, echo=True)  # fmt: skip
    full, part = echoed.choices[0].logprobs, plain.choices[0].logprobs
    assert echoed.choices[0].text == prompt + plain.choices[0].text
    assert len(full.tokens) == len(ids) + 3 and full.tokens[len(ids) :] == part.tokens
    assert full.token_logprobs[0] is None and full.top_logprobs[0] is None
    assert all(lp <= 0 for lp in full.token_logprobs[1:])
    assert full.token_logprobs[len(ids) :] == pytest.approx(part.token_logprobs, abs=1e-4)
    assert full.text_offset == sorted(full.text_offset)
    assert full.text_offset[len(ids)] == len(prompt)
    # Streamed, the first chunk carries the echoed prompt and its logprobs.
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0,
                                       logprobs=2, echo=True, stream=True)  # fmt: skip
    chunks = [c.choices[0] for c in stream if c.choices]
    assert chunks[0].text.startswith(prompt)
    streamed = [lp for c in chunks if c.logprobs for lp in c.logprobs.token_logprobs]
    assert streamed[0] is None
    assert streamed[1:] == pytest.approx(full.token_logprobs[1:], abs=1e-4)
    # max_tokens 0 is for scoring: allowed with echo only.
    only = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True,
                                     logprobs=0)  # fmt: skip
    assert only.choices[0].text == prompt and only.usage.completion_tokens == 0
    assert only.choices[0].logprobs.token_logprobs[1:] == pytest.approx(
        full.token_logprobs[1 : len(ids)], abs=1e-4
    )
    bad = httpx.post(server[0] + "/v1/completions",
                     json={"model": MODEL, "prompt": prompt, "max_tokens": 0})  # fmt: skip
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"


@pytest.mark.parametrize(
    ("path", "field", "refused", "accepted"),
    [
        ("/v1/completions", "use_beam_search", True, False),
        ("/v1/completions", "best_of", 3, 1),
        ("/v1/completions", "priority", 5, 0),
        ("/v1/completions", "truncate_prompt_tokens", 4, None),
        ("/v1/chat/completions", "logits_processors", ["my.module:proc"], None),
        ("/v1/chat/completions", "echo", True, False),
        ("/v1/chat/completions", "add_special_tokens", True, False),
        ("/v1/completions", "add_special_tokens", False, True),
        ("/v1/chat/completions", "stream_options", {"continuous_usage_stats": True},
         {"include_usage": False}),
    ],
)  # fmt: skip
def test_fields_without_machinery_are_refused_unless_they_ask_nothing(
    server, path, field, refused, accepted
):
    body = {"model": MODEL, "max_tokens": 2}
    body |= {"prompt": "Hi"} if path == "/v1/completions" else {"messages": QUESTION}
    bad = httpx.post(server[0] + path, json={**body, field: refused})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == field
    assert "not supported" in bad.json()["error"]["message"]
    assert httpx.post(server[0] + path, json={**body, field: accepted}).status_code == 200
    unknown = f"no_such_field_{field}_{path.rsplit('/', 1)[-1]}"  # each name is logged once
    ok = httpx.post(server[0] + path, json={**body, unknown: 1})
    assert ok.status_code == 200
    assert unknown in server[2].state.ctx.fields.logged  # the warning names it once


def test_vllms_prompt_logprobs_field_on_both_apis(client, server):
    prompt = "The capital of France is"
    ids = server[1].tokenizer.encode(prompt, add_special_tokens=False)
    echoed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True,
                                       logprobs=0)  # fmt: skip
    want = echoed.choices[0].logprobs.token_logprobs
    cmpl = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1,
                                     extra_body={"prompt_logprobs": 2})  # fmt: skip
    scored = cmpl.choices[0].model_extra["prompt_logprobs"]
    assert len(scored) == len(ids) and scored[0] is None
    got = [scored[i][str(t)]["logprob"] for i, t in enumerate(ids) if i]
    assert got == pytest.approx(want[1:], abs=1e-4)
    assert all(len(entry) >= 2 for entry in scored[1:])  # the token plus the top 2
    chat = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=1,
                                          extra_body={"prompt_logprobs": 0})  # fmt: skip
    assert chat.model_extra["prompt_logprobs"][0] is None
    assert len(chat.model_extra["prompt_logprobs"]) == chat.usage.prompt_tokens
    streamed = httpx.post(server[0] + "/v1/completions", json={
        "model": MODEL, "prompt": prompt, "stream": True, "prompt_logprobs": 1})  # fmt: skip
    assert streamed.status_code == 400
    assert streamed.json()["error"]["param"] == "prompt_logprobs"


def test_return_token_ids_gives_the_ids_the_text_came_from(client, server):
    """vLLM's return_token_ids: a client can carry a conversation on in token ids (the next
    turn's prompt is this turn's prompt and output ids), whole or streamed."""
    tokenizer = server[1].tokenizer
    ids = tokenizer.encode("The capital of France is", add_special_tokens=False)
    kwargs = dict(model=MODEL, prompt=ids, temperature=0, max_tokens=12, n=2)
    whole = client.completions.create(**kwargs, extra_body={"return_token_ids": True})
    for choice in whole.choices:
        assert choice.model_extra["prompt_token_ids"] == ids
        output = choice.model_extra["token_ids"]
        assert len(output) == whole.usage.completion_tokens // 2
        assert tokenizer.decode(output) == choice.text
    plain = client.completions.create(**kwargs)
    assert "token_ids" not in (plain.choices[0].model_extra or {})
    # With echo the prompt comes back as ids only (vLLM's rule); null asks for nothing.
    echoed = client.completions.create(**kwargs, echo=True, extra_body={"return_token_ids": True})
    assert [c.text for c in echoed.choices] == [c.text for c in whole.choices]
    null = httpx.post(server[0] + "/v1/completions",
                      json={**kwargs, "prompt": ids, "return_token_ids": None})  # fmt: skip
    assert null.status_code == 200 and "token_ids" not in null.json()["choices"][0]
    chunks = list(client.completions.create(**kwargs, stream=True,
                                            extra_body={"return_token_ids": True}))  # fmt: skip
    for index in (0, 1):
        mine = [c.choices[0].model_extra for c in chunks if c.choices[0].index == index]
        assert mine[0]["prompt_token_ids"] == ids
        assert all("prompt_token_ids" not in extra for extra in mine[1:])
        streamed = [t for extra in mine for t in extra["token_ids"]]
        assert streamed == whole.choices[index].model_extra["token_ids"]

    body = {"return_token_ids": True, "cache_salt": "token-ids"}
    chat = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0,
                                          max_tokens=8, extra_body=body)  # fmt: skip
    prompt_ids = chat.model_extra["prompt_token_ids"]
    assert len(prompt_ids) == chat.usage.prompt_tokens
    output = chat.choices[0].model_extra["token_ids"]
    assert tokenizer.decode(output, skip_special_tokens=True) == chat.choices[0].message.content
    stream = list(client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=8, stream=True,
        extra_body={"return_token_ids": True}))  # fmt: skip
    assert stream[0].model_extra["prompt_token_ids"] == prompt_ids
    assert [t for c in stream for t in c.choices[0].model_extra["token_ids"]] == output
    # The next turn in ids: the cache holds every full block of this turn's prompt and output
    # (all but the last output token were computed).
    history = prompt_ids + output
    follow = client.completions.create(model=MODEL, prompt=history, max_tokens=1, temperature=0,
                                       extra_body={"cache_salt": "token-ids"})  # fmt: skip
    assert follow.usage.prompt_tokens == len(history)
    assert follow.usage.prompt_tokens_details.cached_tokens == (len(history) - 1) // 16 * 16


def test_an_unknown_model_is_model_not_found(client):
    """As OpenAI and vLLM answer: 404, code model_not_found (the openai client's
    NotFoundError)."""
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-4", messages=QUESTION, max_tokens=2)
    assert caught.value.body["code"] == "model_not_found"
    assert caught.value.body["param"] == "model"


def test_invalid_json_is_a_400(server):
    response = httpx.post(
        server[0] + "/v1/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_models_health_version_tokenize_detokenize(client, server):
    url = server[0]
    assert [m.id for m in client.models.list()] == [MODEL]
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/version").json()["version"]
    tokens = httpx.post(url + "/tokenize", json={"prompt": "Hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    assert tokens["max_model_len"] == 512
    text = httpx.post(url + "/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
    assert text == "Hello world"
    chat_tokens = httpx.post(url + "/tokenize", json={"messages": QUESTION}).json()
    assert chat_tokens["count"] > tokens["count"]
    bad = httpx.post(url + "/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400


def test_metrics_parse_and_move(client, server):
    url = server[0]

    def scrape() -> dict[str, float]:
        values = {}
        for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
            for sample in family.samples:
                key = sample.name + json.dumps(sample.labels, sort_keys=True)
                values[key] = sample.value
        return values

    before = scrape()
    client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=5, extra_body={"ignore_eos": True}
    )
    time.sleep(0.2)
    after = scrape()
    length_key = 'forklift:request_success_total{"finished_reason": "length"}'
    assert after[length_key] == before.get(length_key, 0) + 1
    assert (
        after["forklift:generation_tokens_total{}"]
        >= before["forklift:generation_tokens_total{}"] + 5
    )
    assert after["forklift:prompt_tokens_total{}"] > before["forklift:prompt_tokens_total{}"]
    assert after["forklift:e2e_request_latency_seconds_count{}"] == (
        before["forklift:e2e_request_latency_seconds_count{}"] + 1
    )
    for name in (
        "forklift:num_requests_running{}",
        "forklift:num_requests_waiting{}",
        "forklift:kv_cache_usage_perc{}",
        "forklift:num_preemptions_total{}",
        "forklift:time_to_first_token_seconds_count{}",
        "forklift:inter_token_latency_seconds_count{}",
        "forklift:request_queue_time_seconds_count{}",
    ):
        assert name in after


def test_prefix_cache_hits_show_in_usage_and_metrics(client, server):
    url = server[0]

    def hits() -> float:
        for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
            for sample in family.samples:
                if sample.name == "forklift:prefix_cache_hits_total":
                    return sample.value
        raise AssertionError("no prefix-cache hit counter")

    prompt = "A long shared preamble about forklifts and warehouses. " * 8
    body = {"ignore_eos": True, "cache_salt": "test-prefix"}
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, extra_body=body)
    before = hits()
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, extra_body=body)
    time.sleep(0.2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 64 and cached % 16 == 0
    assert hits() == before + cached
    other_salt = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=2, extra_body={**body, "cache_salt": "other"}
    )
    assert other_salt.usage.prompt_tokens_details.cached_tokens == 0


def test_an_unknown_field_is_logged_once_by_name(caplog):
    from forklift.server.field_policy import MAX_LOGGED_NAMES, FieldPolicy

    policy = FieldPolicy()
    with caplog.at_level("WARNING", logger="forklift"):
        for _ in range(3):
            policy.check({"frobnicate": 1, "user": "me"})
    warned = [r for r in caplog.records if "frobnicate" in r.getMessage()]
    assert len(warned) == 1 and "'frobnicate' is not known" in warned[0].getMessage()
    assert policy.logged == {"frobnicate"}  # `user` changes nothing and is not warned about
    policy.check({f"made_up_{i}": 1 for i in range(1000)})
    assert len(policy.logged) == MAX_LOGGED_NAMES + 1  # bounded, however many names come
