"""`forklift serve`: the engine behind uvicorn, announced with one ready line."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import TextIO

import uvicorn

from forklift.config import EngineConfig
from forklift.engine.engine import LLMEngine
from forklift.model.model_source import DEFAULT_MODEL_FILE
from forklift.server.announce import ready_line
from forklift.server.app import build_app
from forklift.server.exposure import check_trainer_routes_exposure
from forklift.server.limits import ServerLimits
from forklift.server.shutdown import DrainingServer

logger = logging.getLogger("forklift")


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
) -> int:
    check_trainer_routes_exposure(host, api_key, enable_trainer_routes)  # before any loading
    engine = LLMEngine(config)
    name = served_model_name or default_served_name(config.model)
    app = build_app(
        engine,
        name,
        api_key,
        max_waiting_requests,
        limits,
        enable_trainer_routes,
        tool_call_parser=tool_call_parser,
    )
    uv_config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False)
    line = ready_line(host, port, name, api_key)
    server = DrainingServer(uv_config, line, out, app.state.ctx.async_engine, shutdown_timeout_s)
    try:
        server.run()
    finally:
        engine.shutdown()  # tensor-parallel workers
    return 1 if server.failed else 0
