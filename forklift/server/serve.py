"""`forklift serve`: the engine behind uvicorn, announced with one ready line."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import TextIO

import uvicorn

from forklift.config import EngineConfig
from forklift.engine.engine import LLMEngine
from forklift.model.model_source import DEFAULT_MODEL_FILE
from forklift.server.app import build_app
from forklift.server.exposure import check_trainer_routes_exposure
from forklift.server.limits import ServerLimits

logger = logging.getLogger("forklift")


def default_served_name(model: str | None) -> str:
    if model is None:
        return Path(DEFAULT_MODEL_FILE).name.split(".")[0]
    return model


def ready_line(host: str, port: int, model_name: str, api_key: str | None) -> str:
    url = f"http://{host}:{port}"
    body = json.dumps({"model": model_name, "messages": [{"role": "user", "content": "Hello!"}]})
    auth = f" -H 'Authorization: Bearer {api_key}'" if api_key else ""
    return (
        f"forklift: ready at {url}/v1 (model {model_name}); try: curl {url}/v1/chat/completions"
        f" -H 'Content-Type: application/json'{auth} -d '{body}'"
    )


class AnnouncingServer(uvicorn.Server):
    """Prints the ready line once the socket is bound, not before."""

    def __init__(self, config: uvicorn.Config, line: str, out: TextIO) -> None:
        super().__init__(config)
        self._line = line
        self._out = out

    async def startup(self, sockets: list | None = None) -> None:  # type: ignore[override]
        await super().startup(sockets)
        if self.started:
            print(self._line, file=self._out, flush=True)


def serve(
    config: EngineConfig,
    host: str,
    port: int,
    api_key: str | None = None,
    served_model_name: str | None = None,
    max_waiting_requests: int | None = None,
    limits: ServerLimits | None = None,
    enable_trainer_routes: bool = False,
    out: TextIO = sys.stdout,
) -> int:
    check_trainer_routes_exposure(host, api_key, enable_trainer_routes)  # before any loading
    engine = LLMEngine(config)
    name = served_model_name or default_served_name(config.model)
    app = build_app(engine, name, api_key, max_waiting_requests, limits, enable_trainer_routes)
    uv_config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False)
    server = AnnouncingServer(uv_config, ready_line(host, port, name, api_key), out)
    server.run()
    return 0
