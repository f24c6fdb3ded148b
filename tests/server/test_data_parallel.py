"""Data parallelism: the router's choices, and two Ray replicas behind one front end."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest
from tiny_models import make_tiny_model

from forklift import LLM, SamplingParams
from forklift.bench.server_process import forklift_server
from forklift.dp.router import Router, RoutingPolicy, estimated_tokens, prompt_text


def _router(replicas: int = 2, **policy) -> Router:
    router = Router(replicas, RoutingPolicy(**policy))
    for i in range(replicas):
        router.mark_up(i, f"http://replica-{i}")
    return router


def test_least_loaded_replica_wins_and_idle_ties_rotate():
    router = _router(3)
    picks = []
    for _ in range(3):
        index = router.choose(None)
        router.acquire(index, 100)
        picks.append(index)
    assert sorted(picks) == [0, 1, 2]
    router.release(1, 100)
    assert router.choose(None) == 1


def test_prefix_affinity_holds_within_the_slack_and_yields_beyond_it():
    router = _router(2, affinity_slack_tokens=500)
    key = router.prefix_key("system: " + "x" * 300)
    first = router.choose(key)
    router.acquire(first, 400)
    assert router.choose(key) == first  # 400 more tokens than the idle one: within slack
    router.acquire(first, 400)
    other = router.choose(key)
    assert other != first  # 800 > 500: load wins, and the key moves with it
    router.acquire(other, 0)
    assert router.choose(key) == other


def test_short_prompts_carry_no_prefix_key_and_down_replicas_are_skipped():
    router = _router(2)
    assert router.prefix_key("hello") is None
    key = router.prefix_key("y" * 400)
    warm = router.choose(key)
    router.mark_down(warm)
    assert router.choose(key) == 1 - warm
    router.mark_down(1 - warm)
    assert router.choose(None) is None
    router.mark_up(warm, "http://new")
    assert router.replicas[warm].restarts_total == 1


def test_prompt_text_and_token_estimates():
    chat = {
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    }
    assert prompt_text(chat) == "system:be brief\nuser:hi\n"
    assert prompt_text({"prompt": ["first", "second"]}) == "first"
    assert prompt_text({"prompt": [5, 6]}) == "5 6"
    assert prompt_text("not a dict") == ""
    assert estimated_tokens({"max_tokens": 10, "n": 3}, "x" * 40) == 10 + 30
    assert estimated_tokens({"max_completion_tokens": 7}, "") == 7


MODEL_NAME = "tiny"
ENGINE_ARGS = ["--dtype", "float32", "--max-model-len", "256", "--block-size", "4",
               "--kv-cache-memory-bytes", str(2**20)]  # fmt: skip


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-dp")
    make_tiny_model("llama", path)
    return path


@pytest.fixture(scope="module")
def dp_url(tiny_dir):
    args = ["--model", str(tiny_dir), "--served-model-name", MODEL_NAME, *ENGINE_ARGS,
            "--data-parallel-size", "2"]  # fmt: skip
    with forklift_server(args, startup_timeout_s=600) as url:
        yield url


def _prompt(i: int, words: int = 6) -> str:
    return " ".join(f"w{(7 * i + j) % 250 + 3}" for j in range(words))


async def _complete_all(url: str, prompts: list[str], max_tokens: int) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=300) as client:
        return await asyncio.gather(
            *(
                client.post(
                    f"{url}/v1/completions",
                    json={
                        "model": MODEL_NAME,
                        "prompt": p,
                        "max_tokens": max_tokens,
                        "temperature": 0,
                        "ignore_eos": True,
                    },
                )  # fmt: skip
                for p in prompts
            )
        )


@pytest.mark.slow
def test_concurrent_requests_spread_over_both_replicas_with_single_replica_outputs(
    dp_url, tiny_dir
):
    prompts = [_prompt(i) for i in range(16)]
    responses = asyncio.run(_complete_all(dp_url, prompts, max_tokens=8))
    assert all(r.status_code == 200 for r in responses)
    served_by = [r.headers["x-forklift-replica"] for r in responses]
    assert set(served_by) == {"0", "1"}, served_by
    single = LLM(model=str(tiny_dir), dtype="float32", max_model_len=256, block_size=4,
                 kv_cache_memory_bytes=2**20)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = [o.outputs[0].text for o in single.generate(prompts, params, use_tqdm=False)]
    assert [r.json()["choices"][0]["text"] for r in responses] == expected
    table = httpx.get(f"{dp_url}/v1/replicas").json()["data"]
    assert all(row["routed_total"] >= 1 and row["healthy"] for row in table)
    metrics = httpx.get(f"{dp_url}/metrics").text
    assert 'forklift:replica_routed_requests_total{replica="0"}' in metrics
    assert 'forklift:replica_outstanding_tokens{replica="1"} 0' in metrics


@pytest.mark.slow
def test_requests_sharing_a_long_prefix_land_on_one_replica(dp_url):
    shared = _prompt(99, words=80)  # about 400 characters
    prompts = [f"{shared} {_prompt(i, words=3)}" for i in range(8)]
    responses = asyncio.run(_complete_all(dp_url, prompts, max_tokens=4))
    assert all(r.status_code == 200 for r in responses)
    assert len({r.headers["x-forklift-replica"] for r in responses}) == 1
    # Short prompts sent at the same time still spread.
    mixed = asyncio.run(_complete_all(dp_url, [_prompt(i) for i in range(8)], max_tokens=4))
    assert len({r.headers["x-forklift-replica"] for r in mixed}) == 2


@pytest.mark.slow
def test_the_status_snapshot_has_one_panel_per_replica(dp_url):
    page = httpx.get(f"{dp_url}/status")
    assert page.status_code == 200 and 'id="panels"' in page.text
    replicas = httpx.get(f"{dp_url}/status.json").json()["replicas"]
    assert [r["index"] for r in replicas] == [0, 1]
    for replica in replicas:
        assert replica["healthy"] and replica["error"] is None
        snapshot = replica["status"]["snapshot"]
        assert snapshot["config"]["block_size"] == 4
        assert len(snapshot["blocks"]["states"]) == snapshot["config"]["num_blocks"]


@pytest.mark.slow
def test_a_killed_replica_loses_no_unstarted_request_and_comes_back(dp_url):
    table = httpx.get(f"{dp_url}/v1/replicas").json()["data"]
    victim = table[0]

    async def load_and_kill() -> list[httpx.Response]:
        task = asyncio.ensure_future(
            _complete_all(dp_url, [_prompt(i) for i in range(16)], max_tokens=240)
        )
        async with httpx.AsyncClient() as client:
            while True:  # kill it while it holds requests
                rows = (await client.get(f"{dp_url}/v1/replicas")).json()["data"]
                if rows[0]["outstanding_requests"] >= 4 or task.done():
                    break
                await asyncio.sleep(0.02)
        os.kill(victim["pid"], signal.SIGKILL)
        return await task

    responses = asyncio.run(load_and_kill())
    # Non-streaming requests send nothing before they finish, so every one is retried.
    assert [r.status_code for r in responses] == [200] * 16
    assert all(r.json()["usage"]["completion_tokens"] == 240 for r in responses)
    # Half went to the victim at first; those were answered by the survivor instead.
    served_by = [r.headers["x-forklift-replica"] for r in responses]
    assert served_by.count("1") > 8, served_by
    deadline = time.monotonic() + 180
    while True:
        row = httpx.get(f"{dp_url}/v1/replicas").json()["data"][0]
        if row["healthy"] and row["restarts_total"] >= 1:
            break
        assert time.monotonic() < deadline, row
        time.sleep(1)
    assert row["failures_total"] >= 1 and row["pid"] != victim["pid"]
    again = asyncio.run(_complete_all(dp_url, [_prompt(i) for i in range(4)], max_tokens=4))
    assert [r.status_code for r in again] == [200] * 4


def test_front_end_checks_the_api_key_and_says_when_no_replica_is_up():
    from fastapi.testclient import TestClient

    from forklift.dp.frontend import Frontend, FrontendSettings, build_frontend_app

    async def nothing() -> None:
        return None

    frontend = Frontend([], Router(0), FrontendSettings(api_key="secret"))
    with TestClient(build_frontend_app(frontend, nothing)) as client:
        body = {"model": MODEL_NAME, "prompt": "hi"}
        denied = client.post("/v1/completions", json=body)
        assert denied.status_code == 401
        assert denied.json()["error"]["message"] == "invalid API key"
        auth = {"Authorization": "Bearer secret"}
        busy = client.post("/v1/completions", json=body, headers=auth)
        assert busy.status_code == 503 and "no replica" in busy.json()["error"]["message"]
        assert client.get("/health").status_code == 503


def test_front_end_bounds_request_bodies_before_proxying():
    from fastapi.testclient import TestClient

    from forklift.dp.frontend import Frontend, FrontendSettings, build_frontend_app
    from forklift.server.limits import ServerLimits

    async def nothing() -> None:
        return None

    limits = ServerLimits(max_body_bytes=1000, max_weights_body_bytes=2000)
    frontend = Frontend([], Router(0), FrontendSettings(limits=limits))
    with TestClient(build_frontend_app(frontend, nothing)) as client:
        big = client.post("/v1/completions", content=b"x" * 1500)
        assert big.status_code == 413
        assert set(big.json()["error"]) == {"message", "type", "param", "code"}
        assert "1000 bytes" in big.json()["error"]["message"]
        chunked = client.post("/v1/completions", content=iter([b"x" * 600, b"x" * 600]))
        assert chunked.status_code == 413 and "error" in chunked.json()
        # /v1/weights has its own limit; under it the request goes on (no replica here).
        assert client.post("/v1/weights", content=b"x" * 1500).status_code == 503
        assert client.post("/v1/weights", content=b"x" * 2500).status_code == 413


def test_front_end_refuses_new_requests_while_draining():
    from fastapi.testclient import TestClient

    from forklift.dp.frontend import Frontend, FrontendSettings, build_frontend_app

    async def nothing() -> None:
        return None

    frontend = Frontend([], Router(0), FrontendSettings())
    assert frontend.is_idle()
    frontend.stop_accepting()
    with TestClient(build_frontend_app(frontend, nothing)) as client:
        refused = client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "hi"})
        assert refused.status_code == 503
        assert "shutting down" in refused.json()["error"]["message"]
        assert client.get("/health").status_code == 503
