"""Bounded requests: every size a client controls has a limit, checked before the engine."""

from __future__ import annotations

import time

import httpx
import pytest
from server_harness import running_server
from tiny_models import make_tiny_model

from forklift import LLM, SamplingParams
from forklift.config import EngineConfig
from forklift.engine.engine import LLMEngine
from forklift.server.app import build_app
from forklift.server.limits import ServerLimits

MAX_MODEL_LEN = 256
LIMITS = ServerLimits(max_body_bytes=64 * 1024, max_weights_body_bytes=4096)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-limits")
    make_tiny_model("llama", directory)
    return directory


def make_engine(tiny_dir) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(tiny_dir),
            dtype="float32",
            max_model_len=MAX_MODEL_LEN,
            kv_cache_memory_bytes=2**20,
            max_num_seqs=4,
        )
    )


@pytest.fixture(scope="module")
def engine(tiny_dir):
    return make_engine(tiny_dir)


@pytest.fixture(scope="module")
def url(engine):
    app = build_app(engine, "tiny", limits=LIMITS, enable_trainer_routes=True)
    with running_server(app) as base:
        yield base


def test_engine_config_rejects_non_positive_limits():
    with pytest.raises(ValueError, match="max_n"):
        EngineConfig(max_n=0)
    with pytest.raises(ValueError, match="max_body_bytes"):
        ServerLimits(max_body_bytes=0)


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (dict(n=100_000), "max_n=128"),
        (dict(logprobs=21), "max_logprobs=20"),
        (dict(stop=[f"s{i}" for i in range(33)]), "max_stop_strings=32"),
        (dict(stop=["x" * 513]), "max_stop_string_chars=512"),
        (dict(stop_token_ids=list(range(257))), "max_stop_token_ids=256"),
    ],
)
def test_engine_rejects_requests_over_a_limit_and_stays_untouched(engine, params, field):
    with pytest.raises(ValueError, match=field):
        engine.add_request(None, [5, 6, 7], SamplingParams(**params))
    assert not engine.has_unfinished_requests()


def test_llm_validates_the_same_limits(tiny_dir):
    llm = LLM(model=str(tiny_dir), dtype="float32", max_model_len=64, max_n=2)
    with pytest.raises(ValueError, match="SamplingParams.n is 3, more than the limit max_n=2"):
        llm.generate([[5, 6]], SamplingParams(n=3), use_tqdm=False)
    out = llm.generate([[5, 6]], SamplingParams(n=2, max_tokens=2), use_tqdm=False)
    assert len(out[0].outputs) == 2


def _completion(**fields):
    return {"model": "tiny", "prompt": "w5 w6 w7", "max_tokens": 2, **fields}


@pytest.mark.parametrize(
    ("path", "body", "param", "limit"),
    [
        ("/v1/completions", _completion(n=100_000), "n", "max_n=128"),
        ("/v1/completions", _completion(best_of=1000), "best_of", "max_n=128"),
        ("/v1/completions", _completion(logprobs=1000), "logprobs", "max_logprobs=20"),
        (
            "/v1/chat/completions",
            {
                "model": "tiny",
                "messages": [{"role": "user", "content": "w5"}],
                "logprobs": True,
                "top_logprobs": 50,
            },  # fmt: skip
            "top_logprobs",
            "max_logprobs=20",
        ),
        ("/v1/completions", _completion(stop=["w9"] * 40), "stop", "max_stop_strings=32"),
        ("/v1/completions", _completion(stop=["x" * 600]), "stop", "max_stop_string_chars=512"),
        (
            "/v1/completions",
            _completion(stop_token_ids=[3] * 300),
            "stop_token_ids",
            "max_stop_token_ids=256",
        ),
        (
            "/v1/completions",
            _completion(logit_bias={str(i): 1 for i in range(301)}),
            "logit_bias",
            "max_logit_bias=300",
        ),
        ("/v1/completions", _completion(prompt=["w5"] * 129), "prompt", "max_prompts_per_request"),
    ],
)
def test_a_field_over_its_limit_is_a_400_naming_it(url, engine, path, body, param, limit):
    started = time.monotonic()
    response = httpx.post(url + path, json=body, timeout=30)
    assert time.monotonic() - started < 5
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert limit in error["message"]
    assert not engine.has_unfinished_requests()


def test_n_of_100000_leaves_the_server_answering(url):
    assert httpx.post(url + "/v1/completions", json=_completion(n=100_000)).status_code == 400
    ok = httpx.post(url + "/v1/completions", json=_completion(), timeout=30)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_max_tokens_past_the_context_is_a_400_in_vllms_words(url):
    response = httpx.post(url + "/v1/completions", json=_completion(max_tokens=10**9))
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "max_tokens"
    assert error["message"] == (
        f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, you "
        f"requested {10**9 + 3} tokens (3 in the messages, {10**9} in the completion). "
        "Please reduce the length of the messages or completion."
    )
    # Exactly filling the context is allowed.
    fits = httpx.post(url + "/v1/completions", json=_completion(max_tokens=MAX_MODEL_LEN - 3))
    assert fits.status_code == 200, fits.text


def test_offline_engine_still_stops_at_max_model_len(tiny_dir):
    # Its own engine: the module's one is stepped by the server's engine thread.
    engine = make_engine(tiny_dir)
    rid = engine.add_request(None, [5, 6, 7], SamplingParams(max_tokens=10**9, ignore_eos=True))
    while engine.has_unfinished_requests():
        outputs = engine.step()
    (final,) = [o for o in outputs if o.request_id == rid]
    assert len(final.outputs[0].token_ids) == MAX_MODEL_LEN - 3


def test_bodies_over_the_byte_limit_are_413s(url):
    big = _completion(prompt="w5 " * 30_000)  # ~90 kB, over the 64 kB limit
    declared = httpx.post(url + "/v1/completions", json=big)
    assert declared.status_code == 413
    assert declared.json()["error"]["type"] == "invalid_request_error"
    assert "65536 bytes" in declared.json()["error"]["message"]

    def chunks():  # no Content-Length: the bytes received are counted
        for _ in range(100):
            yield b" " * 1024

    chunked = httpx.post(
        url + "/v1/completions", content=chunks(), headers={"content-type": "application/json"}
    )
    assert chunked.status_code == 413
    assert set(chunked.json()["error"]) == {"message", "type", "param", "code"}


def test_weights_bodies_have_their_own_limit(url):
    response = httpx.post(url + "/v1/weights", content=b"\0" * 5000)
    assert response.status_code == 413
    assert "4096 bytes" in response.json()["error"]["message"]
    # Under the limit, the body is parsed (and this one is no safetensors payload).
    small = httpx.post(url + "/v1/weights", content=b"\0" * 100)
    assert small.status_code == 400 and "safetensors" in small.json()["error"]["message"]
