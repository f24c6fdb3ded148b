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
# The tiny model ships no chat template; without one a chat request is refused before any
# rendering. This one renders any role and content.
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}w3{% endif %}"
)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-loop")
    make_tiny_model("llama", directory)
    (directory / "chat_template.jinja").write_text(TEMPLATE)
    return LLMEngine(
        EngineConfig(
            model=str(directory), dtype="float32", max_model_len=256, kv_cache_memory_bytes=2**20
        )
    )


@pytest.fixture(scope="module")
def url(engine):
    with running_server(build_app(engine, "tiny")) as base:
        yield base


class SlowCall:
    """Wraps a tokenizer method so each call takes SLOW_S longer, and records when the
    first call is running."""

    def __init__(self, real):
        self.real = real
        self.entered = threading.Event()
        self.finished = threading.Event()

    def __call__(self, *args, **kwargs):
        self.entered.set()
        time.sleep(SLOW_S)  # stands in for a very long prompt or template
        self.finished.set()
        return self.real(*args, **kwargs)


def _health_while(url: str, path: str, body: dict, slow: SlowCall) -> httpx.Response:
    """Send `body` in the background and, while its slow preparation runs, check that
    /health answers before that preparation ends."""
    result: dict[str, httpx.Response] = {}
    worker = threading.Thread(
        target=lambda: result.setdefault("r", httpx.post(url + path, json=body, timeout=60))
    )
    worker.start()
    assert slow.entered.wait(timeout=30), "the request never reached the slowed call"
    started = time.monotonic()
    assert httpx.get(url + "/health", timeout=60).status_code == 200
    latency = time.monotonic() - started
    # Answered while the slowed call still ran: it did not hold the event loop.
    assert not slow.finished.is_set()
    assert latency < SLOW_S / 2
    worker.join(timeout=60)
    return result["r"]


def test_tokenizing_a_prompt_does_not_block_the_event_loop(engine, url, monkeypatch):
    slow = SlowCall(engine.tokenizer.encode)
    monkeypatch.setattr(engine.tokenizer, "encode", slow)
    body = {"model": "tiny", "prompt": "w5 w6", "max_tokens": 2}
    response = _health_while(url, "/v1/completions", body, slow)
    assert response.status_code == 200


def test_rendering_a_chat_template_does_not_block_the_event_loop(engine, url, monkeypatch):
    slow = SlowCall(engine.tokenizer.apply_chat_template)
    monkeypatch.setattr(engine.tokenizer, "apply_chat_template", slow)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "w5"}], "max_tokens": 2}
    response = _health_while(url, "/v1/chat/completions", body, slow)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] == "length"


def test_fanning_out_the_largest_n_is_cheap_on_the_engine_thread(engine):
    wait_until_idle(engine)
    started = time.perf_counter()
    rid = engine.add_request(None, [5, 6, 7], SamplingParams(n=engine.config.max_n, max_tokens=1))
    assert time.perf_counter() - started < 1.0
    engine.abort_request(rid)
    assert engine.num_free_blocks == engine.num_usable_blocks
