"""`forklift serve`: the engine behind uvicorn, announced with one ready line."""

from __future__ import annotations

import logging
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

import uvicorn

from forklift.checkpoint.source import DEFAULT_MODEL_FILE
from forklift.config import EngineConfig
from forklift.engine.engine import LLMEngine
from forklift.lora_request import LoRARequest
from forklift.server.announce import ready_line
from forklift.server.app import build_app
from forklift.server.exposure import check_trainer_routes_exposure
from forklift.server.limits import ServerLimits
from forklift.server.shutdown import DrainingServer

logger = logging.getLogger("forklift")

# The OS-level name of the thread that runs the event loop (benchmarks find it by name).
HTTP_THREAD_NAME = "forklift-http"


def name_this_thread(name: str) -> None:
    """Set the calling thread's OS name (Linux; elsewhere a no-op), so `top -H`, psutil and
    benchmarks can tell the event loop from the engine."""
    try:
        Path(f"/proc/self/task/{threading.get_native_id()}/comm").write_text(name[:15])
    except OSError:
        pass


def default_served_name(model: str | None) -> str:
    if model is None:
        return Path(DEFAULT_MODEL_FILE).name.split(".")[0]
    return model


def serve(
    config: EngineConfig,
    host: str,
    port: int,
    api_key: str | None = None,
    served_model_name: str | None = None,
    max_waiting_requests: int | None = None,
    limits: ServerLimits | None = None,
    enable_trainer_routes: bool = False,
    shutdown_timeout_s: float = 30.0,
    out: TextIO = sys.stdout,
    tool_call_parser: str = "hermes",
    lora_modules: Sequence[LoRARequest] = (),
    batch_dir: Path | None = None,
) -> int:
    """Serve until SIGTERM / SIGINT; `lora_modules` are loaded (and checked) first;
    `batch_dir` keeps the files and batches of /v1/files and /v1/batches."""
    check_trainer_routes_exposure(host, api_key, enable_trainer_routes)  # before any loading
    engine = LLMEngine(config)
    name = served_model_name or default_served_name(config.model)
    for adapter in lora_modules:
        if adapter.lora_name == name:
            raise ValueError(f"--lora-modules: {name!r} is the served model's name")
        engine.add_lora(adapter)
    app = build_app(
        engine,
        name,
        api_key,
        max_waiting_requests,
        limits,
        enable_trainer_routes,
        tool_call_parser=tool_call_parser,
        engine_thread=False,
        batch_dir=batch_dir,
    )
    async_engine = app.state.ctx.async_engine
    uv_config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False)
    line = ready_line(host, port, name, api_key)
    server = DrainingServer(uv_config, line, out, async_engine, shutdown_timeout_s)
    # The engine loop keeps the main thread (the one that loaded the model: see
    # AsyncEngine.run_here); HTTP runs beside it. Signals are delivered to the main thread,
    # whose Python code runs between kernels, and handed to the server from there.
    exit_code: list[int] = []

    def serve_http() -> None:
        name_this_thread(HTTP_THREAD_NAME)
        try:
            server.run()
        except SystemExit as exc:  # uvicorn exits this way when it cannot bind
            exit_code.append(exc.code if isinstance(exc.code, int) else 1)
        finally:
            async_engine.shutdown()

    http = threading.Thread(target=serve_http, name=HTTP_THREAD_NAME, daemon=True)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, server.handle_exit)
    http.start()
    try:
        async_engine.run_here()
    finally:
        server.should_exit = True
        http.join(timeout=60)
        engine.shutdown()  # tensor-parallel workers
    if server.failed or exit_code or not server.started or async_engine.failure():
        return 1
    return 0
