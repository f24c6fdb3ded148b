"""Render docs/status.png: the status page of the default model under a small chat load.

Needs Debian's Chromium and the playwright package (both installed by `.ci/run`):

    .venv/bin/python scripts/status_screenshot.py

Eight chat requests of different lengths run for a while; the engine is paused mid-flight
so the picture shows blocks held, shared and cached, and requests in both phases.
"""

from __future__ import annotations

import shutil
import socket
import threading
import time
from pathlib import Path

import httpx
import uvicorn
from playwright.sync_api import sync_playwright

from forklift.config import EngineConfig
from forklift.engine.engine import LLMEngine
from forklift.server.app import build_app

QUESTIONS = [
    "Explain paged attention in two sentences.",
    "Write a haiku about a forklift.",
    "What is continuous batching?",
    "List three uses of a KV cache.",
    "Why is decoding bound by memory bandwidth?",
    "Summarise the history of the printing press.",
    "Give me a recipe for pancakes.",
    "What is the capital of Australia, and why?",
]
SYSTEM = "You are a patient teacher who answers carefully and at length. " * 3


def main() -> None:
    engine = LLMEngine(
        EngineConfig(max_model_len=1024, kv_cache_memory_bytes=48 * 2**20, max_num_seqs=6)
    )
    app = build_app(engine, "SmolLM2-135M-Instruct")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port}"

    def chat(question: str, tokens: int) -> None:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        httpx.post(
            url + "/v1/chat/completions",
            json={"messages": messages, "max_tokens": tokens, "ignore_eos": True},
            timeout=600,
        )

    threads = [
        threading.Thread(target=chat, args=(q, 150 + 40 * i)) for i, q in enumerate(QUESTIONS)
    ]
    for thread in threads:
        thread.start()
        time.sleep(0.7)
    chromium = shutil.which("chromium")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=chromium,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run"],
        )  # fmt: skip
        page = browser.new_page(viewport={"width": 1280, "height": 860})
        page.goto(url + "/status")
        time.sleep(6)  # a few seconds of history for the charts
        app.state.ctx.async_engine.pause()
        time.sleep(1.5)
        page.click("#queue-main tr[data-request-id]")
        out = Path("docs/status.png")
        page.screenshot(path=str(out), full_page=True)
        browser.close()
        print(f"wrote {out}")
    app.state.ctx.async_engine.abort_all()
    for thread in threads:
        thread.join()
    server.should_exit = True


if __name__ == "__main__":
    main()
