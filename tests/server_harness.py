"""Run a forklift app on 127.0.0.1 in a background thread for the duration of a test module."""

from __future__ import annotations

import shutil
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import uvicorn


def forklift_command() -> list[str]:
    """The `forklift` command of this environment (its script, else `python -m forklift`)."""
    script = Path(sys.executable).with_name("forklift")
    if script.exists():
        return [str(script)]
    found = shutil.which("forklift")
    return [found] if found else [sys.executable, "-m", "forklift"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_server(app):
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        if time.time() > deadline:
            raise RuntimeError("server did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def wait_until_idle(engine, timeout: float = 30.0) -> None:
    deadline = time.time() + timeout
    while engine.has_unfinished_requests():
        if time.time() > deadline:
            raise AssertionError("engine still busy")
        time.sleep(0.05)


@contextmanager
def serving_default_model(source, name: str, **config: Any) -> Iterator[tuple[str, Any, Any]]:
    """(url, engine, app): the default model in fp32 behind the app, for a test module."""
    from forklift.config import EngineConfig
    from forklift.engine.engine import LLMEngine
    from forklift.server.app import build_app

    settings = dict(max_model_len=512, kv_cache_memory_bytes=64 * 2**20,
                    max_num_batched_tokens=512) | config  # fmt: skip
    engine = LLMEngine(EngineConfig(model=str(source.path), dtype="float32", **settings))
    app = build_app(engine, name)
    with running_server(app) as url:
        yield url, engine, app
