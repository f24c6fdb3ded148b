"""Speculative decoding behind the server: the openai client sees the same greedy text,
streamed or not, and the speculation counters move on /metrics and /status.json."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_harness import serving_default_model, wait_until_idle

from forklift import SamplingParams

MODEL = "smol-spec"
PASSAGE = (
    "The committee met on Tuesday to review the budget. The committee approved the budget "
    "for the new library, and the committee asked the mayor to review the budget again."
)
PROMPT = f"Repeat the text exactly.\nText: {PASSAGE}\nRepeated text: {PASSAGE[:40]}"


@pytest.fixture(scope="module")
def server(default_source):
    spec = {"method": "ngram", "num_speculative_tokens": 4}
    with serving_default_model(default_source, MODEL, speculative_config=spec) as served:
        yield served


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)


def metric(url: str, name: str) -> float:
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise AssertionError(f"{name} is not on /metrics")


def test_completions_match_offline_greedy_and_counters_move(client, server, default_llm_fp32):
    url, engine, _ = server
    expected = default_llm_fp32.generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=40), use_tqdm=False
    )[0].outputs[0]
    drafts_before = metric(url, "forklift:spec_decode_num_drafts_total")
    reply = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=40)
    assert reply.choices[0].text == expected.text
    assert reply.usage.completion_tokens == len(expected.token_ids)
    stream = client.completions.create(
        model=MODEL, prompt=PROMPT, temperature=0, max_tokens=40, stream=True
    )
    assert "".join(chunk.choices[0].text for chunk in stream) == expected.text
    wait_until_idle(engine)
    assert metric(url, "forklift:spec_decode_num_drafts_total") > drafts_before
    accepted = metric(url, "forklift:spec_decode_num_accepted_tokens_total")
    assert 0 < accepted <= metric(url, "forklift:spec_decode_num_draft_tokens_total")
    status = json.loads(httpx.get(url + "/status.json").text)
    spec = status["snapshot"]["config"]["speculative"]
    assert spec["method"] == "ngram" and spec["mean_acceptance_length"] > 1.0
