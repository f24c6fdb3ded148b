"""GET /status and /status.json on a running server; the page in a real headless Chromium."""

from __future__ import annotations

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
    deadline = time.time() + 30
    while engine.scheduler.num_running < expected_running or engine.kv_cache.usage() == 0:
        assert time.time() < deadline, "requests never started"
        time.sleep(0.002)
    app.state.ctx.async_engine.pause()


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
        assert max(blocks["references"]) == 4
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
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run"],
        )  # fmt: skip
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
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
            tables = [engine.kv_cache.block_table(r.request_id) for r in engine.scheduler.running]
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
        finally:
            app.state.ctx.async_engine.resume()
            browser.close()
    for thread in threads:
        thread.join()
    wait_until_idle(engine)
    assert (tmp_path / "status.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
