"""One data-parallel replica: a whole forklift server (engine + HTTP API) inside a Ray actor.

The actor builds an engine, serves the usual OpenAI-compatible app on a free port of its
node, and reports the URL. Ray restarts an actor whose process dies; the restarted actor
runs this constructor again, so it comes back with a fresh engine on a new port.
"""

from __future__ import annotations

import os
import queue
import socket
import threading
import time
from typing import Any

import uvicorn

from forklift.config import EngineConfig
from forklift.engine.engine import LLMEngine
from forklift.server.app import build_app
from forklift.server.limits import ServerLimits


class ReplicaServer:
    def __init__(
        self,
        engine_kwargs: dict[str, Any],
        served_model_name: str,
        api_key: str | None,
        host: str | None,
        enable_trainer_routes: bool = False,
        limits: ServerLimits | None = None,
        tool_call_parser: str = "hermes",
    ) -> None:
        if host is None:  # on a node of a Ray cluster: the address other nodes reach it at
            import ray

            host = ray.util.get_node_ip_address()
        engine = self._start_engine(engine_kwargs)
        app = build_app(
            engine,
            served_model_name,
            api_key,
            limits=limits,
            enable_trainer_routes=enable_trainer_routes,
            tool_call_parser=tool_call_parser,
            engine_thread=False,
        )
        self._app_ready.put(app)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        self._url = f"http://{host}:{sock.getsockname()[1]}"
        config = uvicorn.Config(app, log_level="warning", access_log=False)
        self._server = uvicorn.Server(config)
        thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        deadline = time.monotonic() + 60
        while not self._server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the replica's HTTP server did not start")
            time.sleep(0.05)

    def _start_engine(self, engine_kwargs: dict[str, Any]) -> LLMEngine:
        """Build the engine on the thread that will step it, and keep it there.

        The actor's own thread must return from this constructor, so the loop cannot run on
        it; one thread that both loads the model and steps it is what keeps torch's OpenMP
        workers fast (see AsyncEngine.run_here)."""
        built: queue.Queue[LLMEngine | BaseException] = queue.Queue()
        self._app_ready: queue.Queue[Any] = queue.Queue()

        def engine_main() -> None:
            try:
                engine = LLMEngine(EngineConfig.from_kwargs(**engine_kwargs))
            except BaseException as exc:  # handed to the constructor, which raises it
                built.put(exc)
                return
            built.put(engine)
            self._app_ready.get().state.ctx.async_engine.run_here()

        threading.Thread(target=engine_main, name="forklift-engine", daemon=True).start()
        result = built.get()
        if isinstance(result, BaseException):
            raise result
        return result

    def url(self) -> str:
        return self._url

    def pid(self) -> int:
        return os.getpid()
