"""GET /status and /status.json on a running server; the page in a real headless Chromium."""

from __future__ import annotations

import json
import shutil
import threading
import time

import httpx
import pytest
from server_harness import running_server, wait_until_idle
from tiny_models import make_tiny_model

from forklift.config import EngineConfig
from forklift.engine.engine import LLMEngine
from forklift.server.app import build_app

KEY = "status-key"
# 2 layers x 2 KV heads x head_dim 16 x fp32, K and V, 4-token blocks: 1000 blocks, one cell
# each on the page.
BLOCK_BYTES = 2 * 2 * 2 * 16 * 4 * 4
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-status-server")
    make_tiny_model("llama", directory)
    engine = LLMEngine(
        EngineConfig(
            model=str(directory),
            dtype="float32",
            max_model_len=256,
            block_size=4,
            max_num_batched_tokens=64,
            kv_cache_memory_bytes=1000 * BLOCK_BYTES,
            enforce_eager=True,
        )
    )
    app = build_app(engine, "tiny", api_key=KEY)
    with running_server(app) as url:
        yield url, app


def launch_chromium(playwright):
    """Debian's Chromium, headless, with the background services that would try to reach
    the network turned off."""
    return playwright.chromium.launch(
        executable_path=CHROMIUM,
        args=["--no-sandbox", "--disable-gpu", "--disable-background-networking",
              "--disable-component-update", "--disable-sync", "--no-first-run"],
    )  # fmt: skip


def get_status(url: str) -> httpx.Response:
    return httpx.get(url + "/status.json", headers={"Authorization": f"Bearer {KEY}"})


def start_load(url: str, count: int, max_tokens: int) -> list[threading.Thread]:
    def one(i: int) -> None:
        httpx.post(
            url + "/v1/completions",
            json={"prompt": list(range(3, 40 + i)), "max_tokens": max_tokens, "ignore_eos": True},
            headers={"Authorization": f"Bearer {KEY}"},
            timeout=120,
        )

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    return threads


def hold_mid_flight(app, expected_running: int) -> None:
    """Pause the engine once requests hold blocks, so a page sees them in flight."""
    engine = app.state.ctx.async_engine.engine
    deadline = time.time() + 60

    def decoding() -> int:
        return sum(1 for r in list(engine.scheduler.running) if r.num_output_tokens > 0)

    while decoding() < expected_running:
        assert time.time() < deadline, "requests never started"
        time.sleep(0.002)
    app.state.ctx.async_engine.pause()
    assert engine.has_unfinished_requests(), "the requests finished before the pause"


def test_the_snapshot_needs_the_key_and_the_page_does_not(server):
    url, _ = server
    assert httpx.get(url + "/status.json").status_code == 401
    page = httpx.get(url + "/status")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    # Self-contained: nothing is loaded from anywhere else.
    assert "http://" not in page.text and "https://" not in page.text
    data = get_status(url).json()
    assert data["served_model_name"] == "tiny"
    assert data["snapshot"]["config"]["block_size"] == 4
    assert data["snapshot"]["config"]["decode_path"] == "torch"  # a dense model
    assert data["state_names"] == ["held_cached", "held", "cached", "free", "null"]


def test_snapshots_are_rate_limited_and_answer_while_paused_or_asleep(server):
    url, app = server
    source, async_engine = app.state.status, app.state.ctx.async_engine
    time.sleep(0.6)
    before = source.num_taken
    for _ in range(5):
        assert get_status(url).status_code == 200
    assert source.num_taken == before + 1
    async_engine.pause()
    try:
        time.sleep(0.6)
        assert get_status(url).json()["state"]["paused"] is True
    finally:
        async_engine.resume()
    async_engine.call(lambda engine: engine.sleep(1)).result(timeout=10)
    try:
        time.sleep(0.6)
        data = get_status(url).json()
        assert data["state"]["sleep_level"] == 1 and data["snapshot"] is not None
    finally:
        async_engine.call(lambda engine: engine.wake_up()).result(timeout=30)


def test_a_long_step_makes_pollers_wait_once_not_in_line(server):
    url, app = server
    async_engine = app.state.ctx.async_engine
    time.sleep(0.6)
    blocker = async_engine.call(lambda engine: time.sleep(3.5))  # a step that runs long
    results: list[tuple[float, bool]] = []

    def poll() -> None:
        started = time.monotonic()
        data = get_status(url).json()
        results.append((time.monotonic() - started, data["state"]["stale"]))

    pollers = [threading.Thread(target=poll) for _ in range(4)]
    for thread in pollers:
        thread.start()
    for thread in pollers:
        thread.join()
    blocker.result(timeout=10)
    # Each gave up after one timeout (2 s), together, with the last snapshot marked stale.
    assert all(stale for _, stale in results) and max(t for t, _ in results) < 3.2
    time.sleep(0.6)
    assert get_status(url).json()["state"]["stale"] is False


def test_a_failing_snapshot_is_reported_not_a_500(server, monkeypatch):
    url, app = server
    time.sleep(0.6)
    kv = app.state.ctx.async_engine.engine.kv_manager

    def broken() -> dict:
        raise RuntimeError("boom")

    monkeypatch.setattr(kv, "block_tables", broken)
    response = get_status(url)
    assert response.status_code == 200
    assert response.json()["state"]["error"] == "RuntimeError: boom"
    monkeypatch.undo()
    time.sleep(0.6)
    assert get_status(url).json()["state"]["error"] is None


def test_in_flight_requests_show_in_the_snapshot_and_history(server):
    url, app = server
    threads = start_load(url, count=4, max_tokens=150)
    hold_mid_flight(app, expected_running=4)
    try:
        time.sleep(0.6)
        data = get_status(url).json()
        requests = data["snapshot"]["requests"]
        assert len(requests) == 4 and {r["status"] for r in requests} == {"running"}
        assert all(r["blocks"] > 0 and r["cells"] for r in requests)
        blocks = data["snapshot"]["blocks"]
        assert blocks["group"] == 1
        # The prompts share a prefix: shared blocks are held once, referenced by several.
        assert sum(blocks["held"]) == len(set().union(*(r["cells"] for r in requests)))
        assert sum(blocks["references"]) == sum(r["blocks"] for r in requests)
    finally:
        app.state.ctx.async_engine.resume()
    for thread in threads:
        thread.join()
    time.sleep(0.6)
    history = get_status(url).json()["history"]
    assert sum(history["generation_tps"]) * history["interval_s"] >= 4 * 150
    assert any(v is not None for v in history["itl_p50_ms"])


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium installed (Debian: apt install chromium)")
def test_the_page_draws_the_block_map_and_queues_in_chromium(server, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    url, app = server
    engine = app.state.ctx.async_engine.engine
    threads = start_load(url, count=5, max_tokens=200)
    hold_mid_flight(app, expected_running=5)
    with sync_api.sync_playwright() as playwright:
        browser = launch_chromium(playwright)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(url + "/status")
            # No key yet: the page asks for one instead of drawing.
            page.wait_for_selector("#keyform", state="visible")
            page.fill("#key", KEY)
            page.click("#keyform button")
            page.wait_for_function(
                "document.querySelectorAll('#queue-main tr[data-request-id]').length === 5"
            )
            held = sum(
                int(page.get_attribute(f'#legend-main [data-state="{state}"]', "data-count"))
                for state in ("held", "held_cached")
            )
            tables = [engine.kv_manager.block_table(r.request_id) for r in engine.scheduler.running]
            assert held == len(set().union(*tables))
            assert page.inner_text("#panel-main .badge") == "paused"
            statuses = page.eval_on_selector_all(
                "#queue-main tr[data-request-id]", "rows => rows.map(r => r.dataset.status)"
            )
            assert statuses == ["running"] * 5
            # Hovering the first cell names the null block; a click selects a request.
            box = page.locator("#blockmap-main").bounding_box()
            page.mouse.move(box["x"] + 2, box["y"] + 2)
            assert "null block" in page.inner_text("#tooltip")
            page.click("#queue-main tr[data-request-id]")
            assert page.locator("#queue-main tr.selected").count() == 1
            assert page.locator(".chart canvas").count() == 6
            page.screenshot(path=str(tmp_path / "status.png"), full_page=True)
            app.state.ctx.async_engine.resume()
            # The requests finish: the queues empty and the map frees its blocks.
            page.wait_for_function(
                "document.querySelector('#queue-main td.empty') !== null", timeout=60_000
            )
            page.wait_for_function(
                "document.querySelector('#legend-main [data-state=\"held\"]').dataset.count === '0'"
            )
            assert page.inner_text("#panel-main .badge") == "running"
            assert errors == []
        finally:
            app.state.ctx.async_engine.resume()
            browser.close()
    for thread in threads:
        thread.join()
    wait_until_idle(engine)
    assert (tmp_path / "status.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def replica_status(group: int, held: int) -> dict:
    """A replica's /status.json as a front end relays it (grouped map, one request)."""
    cells = 8
    states = [1] * held + [3] * (cells - held)
    return {
        "served_model_name": "tiny",
        "state": {"paused": False, "accepting": True, "dead": None, "stale": False,
                  "error": None, "sleep_level": 0},
        "state_names": ["held_cached", "held", "cached", "free", "null"],
        "snapshot": {
            "config": {"model": "m", "architecture": "llama", "dtype": "float32",
                       "quantization": "none", "decode_path": "torch", "device": "cpu",
                       "block_size": 4,
                       "num_blocks": cells * group, "max_num_seqs": 4,
                       "max_num_batched_tokens": 64, "max_model_len": 256,
                       "prefix_caching": True, "weight_version": 3},
            "kv": {"usage": held / cells},
            "blocks": {"group": group, "num_blocks": cells * group, "states": states,
                       "held": [group // 2] * held + [0] * (cells - held),
                       "owner": [0] * held + [-1] * (cells - held),
                       "references": [group // 2] * held + [0] * (cells - held)},
            "requests": [{"request_id": "req-1", "status": "running", "phase": "decode",
                          "prompt_tokens": 10, "output_tokens": 5, "computed_tokens": 14,
                          "blocks": 4, "age_s": 1.0, "queued_s": None, "preemptions": 0,
                          "cells": list(range(held))}],
            "num_waiting": 0,
        },
        "history": None,
    }  # fmt: skip


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium installed (Debian: apt install chromium)")
def test_the_front_end_page_draws_one_panel_per_replica(tmp_path):
    """The page against a data-parallel front end's answer, served by the test itself: a
    replica with a grouped map, and one that is down."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    from forklift.server.status.page import status_page

    answers = [
        {"replicas": [
            {"index": 0, "url": "http://a", "healthy": True, "status": replica_status(4, 3),
             "error": None},
            {"index": 1, "url": "http://b", "healthy": True, "status": replica_status(1, 2),
             "error": None},
        ]},
        {"replicas": [
            {"index": 0, "url": "http://a", "healthy": True, "status": replica_status(4, 3),
             "error": None},
            {"index": 1, "url": "http://b", "healthy": False, "status": None,
             "error": "unreachable: connection refused"},
        ]},
    ]  # fmt: skip
    served = {"count": 0}

    def answer(route) -> None:
        body = answers[min(served["count"], 1)]
        served["count"] += 1
        route.fulfill(status=200, content_type="application/json", body=json.dumps(body))

    with sync_api.sync_playwright() as playwright:
        browser = launch_chromium(playwright)
        try:
            page = browser.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.route("http://frontend.test/status.json", answer)
            page.route(
                "http://frontend.test/status",
                lambda route: route.fulfill(status=200, content_type="text/html",
                                            body=status_page()),
            )  # fmt: skip
            page.goto("http://frontend.test/status")
            page.wait_for_selector("#panel-r0 #queue-r0 tr[data-request-id]")
            assert page.locator("section.panel").count() == 2
            assert "4 per cell" in page.text_content("#panel-r0 h3")
            assert page.get_attribute('#legend-r0 [data-state="held"]', "data-count") == "3"
            assert "cells" in page.inner_text("#legend-r0")
            # The next answer has replica 1 down: its panel says why and shows no old data.
            page.wait_for_function(
                "document.querySelector('#panel-r1 .empty').textContent.includes('unreachable')"
            )
            assert not page.locator("#panel-r1 canvas.blockmap").is_visible()
            assert page.inner_text("#panel-r1 .badge") == "down"
            assert page.inner_text("#state") == "1/2 replicas up"
            assert errors == []
        finally:
            browser.close()
