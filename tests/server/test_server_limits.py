"""API keys, the bounded waiting queue, `forklift serve` and `forklift tokenizer export`."""

from __future__ import annotations

import asyncio
import subprocess

import httpx
import openai
import pytest
import transformers
from server_harness import forklift_command, free_port, running_server, wait_until_idle
from tiny_models import make_tiny_model

from forklift.config import EngineConfig
from forklift.engine.engine import LLMEngine
from forklift.server.app import build_app
from forklift.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny")
    make_tiny_model("llama", directory)
    return LLMEngine(
        EngineConfig(
            model=str(directory),
            dtype="float32",
            max_model_len=256,
            kv_cache_memory_bytes=2**20,
            max_num_seqs=2,
        )
    )


def test_api_key_is_required_on_v1(tiny_engine):
    app = build_app(tiny_engine, "tiny", api_key="s3cret")
    with running_server(app) as url:
        body = {"model": "tiny", "prompt": "w5 w6", "max_tokens": 2}
        wrong = httpx.post(
            url + "/v1/completions", json=body, headers={"Authorization": "Bearer nope"}
        )
        assert wrong.status_code == 401
        assert wrong.json()["error"]["type"] == "authentication_error"
        assert httpx.post(url + "/v1/completions", json=body).status_code == 401
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0).models.list()
        good = openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0)
        assert good.completions.create(**body).usage.completion_tokens == 2
        # Health checks stay open.
        assert httpx.get(url + "/health").status_code == 200


def test_chat_without_a_chat_template_is_a_400_and_completions_still_serve(tiny_engine):
    # The tiny model, like a base model's GGUF file (Gemma 3 270M's), has no chat template.
    app = build_app(tiny_engine, "tiny")
    with running_server(app) as url:
        for stream in (False, True):
            body = {"model": "tiny", "messages": [{"role": "user", "content": "w5"}],
                    "max_tokens": 2, "stream": stream}  # fmt: skip
            reply = httpx.post(url + "/v1/chat/completions", json=body)
            assert reply.status_code == 400
            error = reply.json()["error"]
            assert error["type"] == "invalid_request_error"
            assert "has no chat template" in error["message"]
        body = {"model": "tiny", "prompt": "w5 w6", "max_tokens": 2}
        assert httpx.post(url + "/v1/completions", json=body).status_code == 200


def test_full_waiting_queue_answers_503_with_retry_after(tiny_engine):
    app = build_app(tiny_engine, "tiny", max_waiting_requests=2)
    async_engine = app.state.ctx.async_engine
    with running_server(app) as url:
        body = {"model": "tiny", "prompt": "w5 w6", "max_tokens": 20, "ignore_eos": True}

        async def burst():
            # Held still, the engine queues the first two requests; the rest find it full.
            async_engine.pause()
            async with httpx.AsyncClient(timeout=120) as client:
                tasks = [
                    asyncio.create_task(client.post(url + "/v1/completions", json=body))
                    for _ in range(12)
                ]
                while sum(t.done() for t in tasks) < 10:
                    await asyncio.sleep(0.05)
                async_engine.resume()
                return await asyncio.gather(*tasks)

        responses = asyncio.run(burst())
        statuses = [r.status_code for r in responses]
        assert statuses.count(200) == 2
        assert statuses.count(503) == 10
        rejected = next(r for r in responses if r.status_code == 503)
        assert rejected.headers["retry-after"] == "1"
        assert set(rejected.json()["error"]) == {"message", "type", "param", "code"}
        for r in responses:
            if r.status_code == 200:
                assert r.json()["usage"]["completion_tokens"] == 20
        wait_until_idle(tiny_engine)
        ok = httpx.post(url + "/v1/completions", json={**body, "max_tokens": 3})
        assert ok.status_code == 200
    assert tiny_engine.num_free_blocks == tiny_engine.num_usable_blocks


@pytest.mark.slow
def test_forklift_serve_prints_ready_and_serves(tmp_path):
    port = free_port()
    process = subprocess.Popen(
        [
            *forklift_command(),
            "serve",
            "--port",
            str(port),
            "--dtype",
            "float32",
            "--max-model-len",
            "512",
            "--kv-cache-memory-bytes",
            str(64 * 2**20),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = process.stdout.readline()
        assert f"ready at http://127.0.0.1:{port}/v1" in line
        assert "curl" in line
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        model = client.models.list().data[0].id
        assert model == "SmolLM2-135M-Instruct"
        reply = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            temperature=0,
            max_tokens=16,
        )
        assert "Paris" in reply.choices[0].message.content
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_tokenizer_export_loads_in_transformers(tmp_path, default_source):
    out = tmp_path / "tok"
    result = subprocess.run(
        [*forklift_command(), "tokenizer", "export", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert (out / "tokenizer.json").is_file() and (out / "tokenizer_config.json").is_file()
    ours = Tokenizer.from_gguf(default_source.gguf_reader())
    hf = transformers.AutoTokenizer.from_pretrained(str(out))
    text = "Hello, world! 12345 <|im_start|>user\nhi<|im_end|>"
    assert hf.encode(text, add_special_tokens=False) == ours.encode(text, add_special_tokens=False)
    messages = [{"role": "user", "content": "hi"}]
    assert hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    )


def test_a_dead_engine_answers_503_naming_the_error(tmp_path, monkeypatch):
    make_tiny_model("llama", tmp_path)
    engine = LLMEngine(
        EngineConfig(
            model=str(tmp_path), dtype="float32", max_model_len=64, kv_cache_memory_bytes=2**20
        )  # fmt: skip
    )

    def broken_step():
        raise RuntimeError("tensor-parallel rank 1 exited with code -9")

    monkeypatch.setattr(engine, "step", broken_step)
    app = build_app(engine, "tiny")
    with running_server(app) as url:
        body = {"model": "tiny", "prompt": "w5 w6", "max_tokens": 2}
        first = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        later = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
    for response in (first, later):
        assert response.status_code == 503
        assert "rank 1 exited with code -9" in response.json()["error"]["message"]
    assert app.state.ctx.async_engine.failure() is not None


def test_text_prompts_to_a_model_without_a_tokenizer_are_400s(tmp_path):
    make_tiny_model("llama", tmp_path)
    (tmp_path / "tokenizer.json").unlink()
    engine = LLMEngine(
        EngineConfig(model=str(tmp_path), dtype="float32", kv_cache_memory_bytes=2**20)
    )
    with running_server(build_app(engine, "tiny")) as url:
        text = httpx.post(
            url + "/v1/completions", json={"model": "tiny", "prompt": "w5 w6", "max_tokens": 2}
        )
        assert text.status_code == 400
        assert "no tokenizer" in text.json()["error"]["message"]
        ids = httpx.post(
            url + "/v1/completions", json={"model": "tiny", "prompt": [5, 6], "max_tokens": 2}
        )
        assert ids.status_code == 200
        assert ids.json()["usage"]["completion_tokens"] == 2
