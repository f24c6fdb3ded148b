"""LoRA adapters through the server and the official openai client: `model` picks the
adapter (streamed and not), /v1/models lists adapters with their base, adapters load,
update and unload at run time behind the API key, and bad ones are OpenAI-format errors."""

from __future__ import annotations

import subprocess
import sys

import httpx
import openai
import pytest
from lora_adapters import make_adapter
from peft import get_peft_model_state_dict
from safetensors.torch import save
from server_harness import running_server
from tiny_models import hf_greedy, make_tiny_model

from forklift import EngineConfig, LLMEngine
from forklift.lora_request import LoRARequest
from forklift.server.app import build_app

KEY = "lora-secret"
PROMPT = [5, 17, 33, 9, 41, 12, 7]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    directory = tmp_path_factory.mktemp("lora-server")
    tiny = make_tiny_model("llama", directory / "base")
    adapters = [make_adapter(tiny.hf_model, directory / f"a{i}", 4, seed=i) for i in range(3)]
    engine = LLMEngine(EngineConfig(model=str(tiny.path), dtype="float32", enable_lora=True,
                                    max_loras=2, max_lora_rank=8, max_model_len=128,
                                    num_gpu_blocks_override=64))  # fmt: skip
    engine.add_lora(LoRARequest("first", 1, str(adapters[0].path)))
    app = build_app(engine, "tiny", KEY)
    with running_server(app) as url:
        yield url, tiny, adapters


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY)


def _tokens(client: openai.OpenAI, model: str, stream: bool = False) -> list[int]:
    """The greedy completion's token ids (the tiny model's words are 'w<id>')."""
    params = dict(model=model, prompt=PROMPT, max_tokens=6, temperature=0,
                  extra_body={"ignore_eos": True})  # fmt: skip
    if stream:
        text = "".join(c.choices[0].text for c in client.completions.create(stream=True, **params))
    else:
        text = client.completions.create(**params).choices[0].text
    return [int(word[1:]) for word in text.split()]


def test_model_picks_the_adapter_streamed_and_not(setup):
    url, tiny, adapters = setup
    client = _client(url)
    want = hf_greedy(adapters[0].hf_model, PROMPT, 6)[0]
    assert _tokens(client, "first") == want
    assert _tokens(client, "first", stream=True) == want
    assert _tokens(client, "tiny") == hf_greedy(tiny.hf_model, PROMPT, 6)[0]
    reply = client.completions.create(model="first", prompt=PROMPT, max_tokens=1)
    assert reply.model == "first"
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {"tiny", "first"}
    assert models["first"].model_extra["parent"] == "tiny"
    with pytest.raises(openai.NotFoundError, match="first"):
        client.completions.create(model="nope", prompt=PROMPT, max_tokens=1)
    status = httpx.get(f"{url}/status.json", headers={"Authorization": f"Bearer {KEY}"}).json()
    lora = status["snapshot"]["config"]["lora"]
    assert lora["max_loras"] == 2 and "first" in lora["slots"]
    assert [a["name"] for a in lora["adapters"]] == ["first"]


def test_load_update_and_unload_at_run_time(setup):
    url, _, adapters = setup
    client = _client(url)
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=url, headers=headers, timeout=60) as http:
        body = {"lora_name": "second", "lora_path": str(adapters[1].path)}
        assert httpx.post(f"{url}/v1/load_lora_adapter", json=body).status_code == 401
        loaded = http.post("/v1/load_lora_adapter", json=body)
        assert loaded.status_code == 200, loaded.text
        assert _tokens(client, "second") == hf_greedy(adapters[1].hf_model, PROMPT, 6)[0]
        again = http.post("/v1/load_lora_adapter", json=body)
        assert again.status_code == 400 and "already loaded" in again.json()["error"]["message"]
        bad = http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/nope"})
        assert bad.status_code == 400
        assert "is not a directory" in bad.json()["error"]["message"]
        # A trainer pushes new weights for "second" (here: the third adapter's).
        payload = save(
            {k: v.contiguous() for k, v in get_peft_model_state_dict(adapters[2].hf_model).items()}
        )
        updated = http.post("/v1/update_lora_adapter", params={"lora_name": "second"},
                            content=payload)  # fmt: skip
        assert updated.status_code == 200, updated.text
        assert updated.json()["version"] == 1
        assert _tokens(client, "second") == hf_greedy(adapters[2].hf_model, PROMPT, 6)[0]
        unloaded = http.post("/v1/unload_lora_adapter", json={"lora_name": "second"})
        assert unloaded.status_code == 200
        gone = http.post("/v1/unload_lora_adapter", json={"lora_name": "second"})
        assert gone.status_code == 404
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="second", prompt=PROMPT, max_tokens=1)


def test_serve_refuses_lora_modules_without_enable_lora():
    result = subprocess.run(
        [sys.executable, "-m", "forklift", "serve", "--lora-modules", "a=/x"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2
    assert "--lora-modules needs --enable-lora" in result.stderr
