"""Each request's first-token timeline (arrival, queued, first scheduled, prefill chunks,
first token, first sent): its stamps in order and complete, through the engine and the
server; and a prompt that arrives while others decode is scheduled by the next step."""

from __future__ import annotations

import httpx
import pytest
from server_harness import running_server
from test_engine import BLOCK_BYTES, make_llm, random_prompts
from tiny_models import make_tiny_model

from forklift import SamplingParams
from forklift.config import EngineConfig
from forklift.engine.engine import LLMEngine
from forklift.outputs import RequestMetrics
from forklift.server.app import build_app


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-timeline")
    make_tiny_model("llama", directory)
    return directory


def assert_ordered(metrics: RequestMetrics, prompt_len: int, cached: int = 0) -> None:
    assert metrics.queued_time is not None and metrics.first_scheduled_time is not None
    assert metrics.first_token_time is not None
    assert metrics.arrival_time <= metrics.queued_time <= metrics.first_scheduled_time
    chunks = [c for c in metrics.prefill_chunks if c.start_time <= metrics.first_token_time]
    assert chunks and chunks[0].start_time == metrics.first_scheduled_time
    for before, after in zip(chunks, chunks[1:], strict=False):
        assert before.end_time <= after.start_time
    assert all(c.start_time <= c.end_time and 0 < c.prompt_tokens <= c.step_tokens for c in chunks)
    # The prompt's tokens not found in the cache, each computed once before the first token.
    assert sum(c.prompt_tokens for c in chunks) == prompt_len - cached
    assert chunks[-1].start_time <= metrics.first_token_time <= chunks[-1].end_time


def test_chunked_prompts_record_each_chunk_in_order(tiny_dir):
    llm = make_llm(tiny_dir, max_num_batched_tokens=16, enable_prefix_caching=False)
    prompts = random_prompts(3, seed=4, low=30, high=40)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for prompt, output in zip(prompts, llm.generate(prompts, params, use_tqdm=False), strict=True):
        assert_ordered(output.metrics, len(prompt))
        assert len(output.metrics.prefill_chunks) >= 2  # 30+ tokens, 16 a step
        # Offline there is no event loop: the timeline ends at the sampled token.
        assert output.metrics.first_sent_time is None
        assert output.metrics.first_token_phases() is None


def test_preempted_requests_keep_their_first_timeline(tiny_dir):
    llm = make_llm(tiny_dir, kv_cache_memory_bytes=34 * BLOCK_BYTES)
    prompts = random_prompts(8, seed=1)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    recomputed = 0
    for prompt, output in zip(prompts, outputs, strict=True):
        metrics = output.metrics
        assert_ordered(metrics, len(prompt))
        later = [c for c in metrics.prefill_chunks if c.start_time > metrics.first_token_time]
        recomputed += bool(later)
        metrics.first_sent_time = metrics.first_token_time  # as the server's loop would stamp
        phases = metrics.first_token_phases()
        assert phases is not None and all(v >= 0 for v in phases.values()), phases
        assert phases["ttft_s"] == pytest.approx(sum(v for k, v in phases.items() if k != "ttft_s"))
    assert recomputed > 0  # some prompts were computed again after their first token


def test_a_prompt_arriving_among_decodes_is_scheduled_by_the_next_step(tiny_dir):
    engine = LLMEngine(
        EngineConfig(model=str(tiny_dir), dtype="float32", max_model_len=128, max_num_seqs=8)
    )
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for index, prompt in enumerate(random_prompts(4, seed=2)):
        engine.add_request(f"busy{index}", prompt, params)
    for _ in range(5):
        engine.step()
    engine.add_request("late", random_prompts(1, seed=3)[0], params)
    late = engine.requests.parent("late").metrics
    engine.step()
    # Free sequence slots and the token budget: no step runs without it.
    assert late.first_scheduled_time is not None and late.steps_waited == 0
    # With every slot taken, it waits for the first sequence to finish.
    engine = LLMEngine(
        EngineConfig(model=str(tiny_dir), dtype="float32", max_model_len=128, max_num_seqs=2)
    )
    engine.add_request("short", random_prompts(1, seed=5)[0], SamplingParams(max_tokens=3))
    engine.add_request("long", random_prompts(1, seed=6)[0], params)
    engine.step()
    engine.add_request("late", random_prompts(1, seed=7)[0], params)
    steps = 0
    while engine.requests.parent("late").metrics.first_scheduled_time is None:
        engine.step()
        steps += 1
    assert engine.requests.parent("late").metrics.steps_waited == steps - 1 <= 3


@pytest.mark.parametrize("stream", [True, False])
def test_the_server_keeps_each_finished_requests_timeline(tiny_dir, stream):
    engine = LLMEngine(
        EngineConfig(model=str(tiny_dir), dtype="float32", max_model_len=128, enforce_eager=True)
    )
    with running_server(build_app(engine, "tiny")) as url:
        body = {"prompt": [5, 6, 7, 8, 9, 10], "max_tokens": 3, "stream": stream}
        for _ in range(2):
            reply = httpx.post(url + "/v1/completions", json=body, timeout=30)
            assert reply.status_code == 200, reply.text
        timelines = httpx.get(url + "/status/first_token.json", timeout=30).json()["timelines"]
        assert len(timelines) == 2
        for entry in timelines:
            phases = [entry[k] for k in ("to_engine_ms", "waiting_ms", "prefill_ms")]
            phases += [entry["last_step_ms"], entry["delivery_ms"]]
            assert all(p >= 0 for p in phases), entry
            assert entry["ttft_ms"] == pytest.approx(sum(phases), abs=1e-6)
            assert entry["prefill_chunks"][0]["prompt_tokens"] == 6 - entry["cached_tokens"]
        later = httpx.get(
            url + "/status/first_token.json",
            params={"since": timelines[-1]["arrival_time"] + 1e-3},
            timeout=30,
        )
        assert later.json()["timelines"] == []
        bad = httpx.get(url + "/status/first_token.json", params={"since": "soon"}, timeout=30)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "since", bad.text
        status = httpx.get(url + "/status.json", timeout=30).json()["first_token"]
        assert status["count"] == 2 and status["median"]["ttft_ms"] > 0
