"""Work that grows with a request (tokenizing, chat templates, n samples) never blocks the
event loop: while one request's prompt is being prepared, the server keeps answering."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from server_harness import running_server, wait_until_idle
from tiny_models import make_tiny_model

from forklift import SamplingParams
from forklift.config import EngineConfig
from forklift.engine.engine import LLMEngine
from forklift.server.app import build_app

SLOW_S = 1.5


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-loop")
    make_tiny_model("llama", directory)
    return LLMEngine(
        EngineConfig(
            model=str(directory), dtype="float32", max_model_len=256, kv_cache_memory_bytes=2**20
        )
    )


@pytest.fixture(scope="module")
def url(engine):
    with running_server(build_app(engine, "tiny")) as base:
        yield base


def _health_latency_while(url: str, path: str, body: dict) -> tuple[float, httpx.Response]:
    """Send `body` in the background and time a /health call made while it is prepared."""
    result: dict[str, httpx.Response] = {}
    worker = threading.Thread(
        target=lambda: result.setdefault("r", httpx.post(url + path, json=body, timeout=60))
    )
    worker.start()
    time.sleep(0.3)  # the slow preparation has begun
    started = time.monotonic()
    assert httpx.get(url + "/health", timeout=60).status_code == 200
    latency = time.monotonic() - started
    worker.join(timeout=60)
    return latency, result["r"]


def test_tokenizing_a_prompt_does_not_block_the_event_loop(engine, url, monkeypatch):
    tokenizer = engine.tokenizer
    real_encode = tokenizer.encode

    def slow_encode(text, add_special_tokens=True):
        time.sleep(SLOW_S)  # stands in for a very long prompt
        return real_encode(text, add_special_tokens)

    monkeypatch.setattr(tokenizer, "encode", slow_encode)
    body = {"model": "tiny", "prompt": "w5 w6", "max_tokens": 2}
    latency, response = _health_latency_while(url, "/v1/completions", body)
    assert response.status_code == 200
    assert latency < SLOW_S / 2


def test_rendering_a_chat_template_does_not_block_the_event_loop(engine, url, monkeypatch):
    tokenizer = engine.tokenizer
    real_render = tokenizer.apply_chat_template

    def slow_render(*args, **kwargs):
        time.sleep(SLOW_S)
        return real_render(*args, **kwargs)

    monkeypatch.setattr(tokenizer, "apply_chat_template", slow_render)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "w5"}], "max_tokens": 2}
    latency, response = _health_latency_while(url, "/v1/chat/completions", body)
    assert response.status_code in (200, 400)  # the tiny model may have no template
    assert latency < SLOW_S / 2


def test_fanning_out_the_largest_n_is_cheap_on_the_engine_thread(engine):
    wait_until_idle(engine)
    started = time.perf_counter()
    rid = engine.add_request(None, [5, 6, 7], SamplingParams(n=engine.config.max_n, max_tokens=1))
    assert time.perf_counter() - started < 1.0
    engine.abort_request(rid)
    assert engine.num_free_blocks == engine.num_usable_blocks
