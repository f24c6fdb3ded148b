"""GET /tokenizer_info, /tokenize and /detokenize as lm-evaluation-harness's remote tokenizer
(`tokenizer_backend=remote`) calls them against a vLLM server: the same requests, read the
same way."""

from __future__ import annotations

import json

import httpx
import jinja2
import pytest
from server_harness import serving_default_model

MODEL = "smol"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def server(default_source):
    with serving_default_model(default_source, MODEL) as running:
        yield running


@pytest.fixture(scope="module")
def info(server) -> dict:
    url, _, _ = server
    response = httpx.get(url + "/tokenizer_info")
    assert response.status_code == 200
    return response.json()


def _tokenize(url: str, text: str) -> list[int]:
    # The body lm-eval sends: no model, no special tokens added.
    body = {"prompt": text, "add_special_tokens": False}
    return httpx.post(url + "/tokenize", json=body).json()["tokens"]


def test_info_is_the_exported_tokenizer_config(server, info, tmp_path) -> None:
    _, engine, _ = server
    engine.tokenizer.save(tmp_path)  # what `forklift tokenizer export` writes
    exported = json.loads((tmp_path / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert info == {**exported, "model_max_length": 512}
    assert info["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert info["chat_template"] == engine.tokenizer.chat_template


def test_remote_tokenizer_reads_special_tokens_and_ids(server, info) -> None:
    url, engine, _ = server
    tokenizer = engine.tokenizer
    # lm-eval's support check: an eos_token key, and /tokenize answering a token list.
    assert info["eos_token"] == "<|im_end|>"
    assert _tokenize(url, "test") == tokenizer.encode("test", add_special_tokens=False)
    # Its eos_token_id and bos_token_id: the first id of the token's text.
    assert _tokenize(url, info["eos_token"])[0] == tokenizer.eos_token_id == 2
    assert _tokenize(url, info["bos_token"])[0] == tokenizer.bos_token_id == 1
    ids = _tokenize(url, "Hello <|im_end|> world")
    text = httpx.post(url + "/detokenize", json={"tokens": ids}).json()["prompt"]
    assert text == "Hello <|im_end|> world"


def test_remote_tokenizer_renders_the_served_chat_template(server, info) -> None:
    _, engine, _ = server
    # lm-eval renders the template itself, in a plain Jinja environment.
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    rendered = env.from_string(info["chat_template"]).render(
        messages=CHAT, add_generation_prompt=True
    )
    expected = engine.tokenizer.apply_chat_template(
        CHAT, tokenize=False, add_generation_prompt=True
    )
    assert rendered == expected


def test_tokenize_returns_token_strings_on_request(server) -> None:
    url, engine, _ = server
    body = {"prompt": "Hello world", "return_token_strs": True}
    answer = httpx.post(url + "/tokenize", json=body).json()
    assert answer["token_strs"] == ["Hello", "Ġworld"]
    assert answer["token_strs"] == engine.tokenizer.convert_ids_to_tokens(answer["tokens"])
    plain = httpx.post(url + "/tokenize", json={"prompt": "Hello world"}).json()
    assert plain["token_strs"] is None


def test_chat_template_kwargs_may_not_set_apply_chat_template_arguments(server) -> None:
    url, _, _ = server
    for name, value in (("tokenize", False), ("return_tensors", "pt"), ("chat_template", "x")):
        body = {"model": MODEL, "messages": CHAT, "max_tokens": 1,
                "chat_template_kwargs": {name: value}}  # fmt: skip
        response = httpx.post(url + "/v1/chat/completions", json=body)
        assert response.status_code == 400, name
        error = response.json()["error"]
        assert error["param"] == "chat_template_kwargs"
        assert name in error["message"]
