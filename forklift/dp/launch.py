"""`forklift serve --data-parallel-size N`: N replicas as Ray actors behind one front end.

Without `--ray-address` Ray starts a private local cluster; with it, the replicas are placed
across the nodes of an existing cluster (`ray start --head` on one machine, `ray start
--address HEAD:6379` on the others), one full engine per replica.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from typing import Any, TextIO

import uvicorn

from forklift.config import EngineConfig
from forklift.dp.frontend import Frontend, FrontendSettings, build_frontend_app
from forklift.dp.router import Router
from forklift.server.announce import ready_line
from forklift.server.exposure import check_trainer_routes_exposure
from forklift.server.limits import ServerLimits
from forklift.server.run_server import default_served_name
from forklift.server.shutdown import DrainingServer

# How long the first start of every replica may take (model load included).
_STARTUP_TIMEOUT_S = 900.0


class RayReplicaHandle:
    def __init__(self, actor: Any) -> None:
        self.actor = actor

    async def url(self) -> str:
        return await self.actor.url.remote()

    async def pid(self) -> int:
        return await self.actor.pid.remote()


def replica_engine_kwargs(config: EngineConfig, replicas: int, local: bool) -> dict[str, Any]:
    """Each replica's engine settings; replicas sharing this machine split its cores."""
    kwargs = dataclasses.asdict(config)
    if local and kwargs["num_threads"] is None:
        kwargs["num_threads"] = max(1, (os.cpu_count() or 1) // replicas)
    return kwargs


def serve_data_parallel(
    config: EngineConfig,
    host: str,
    port: int,
    data_parallel_size: int,
    ray_address: str | None = None,
    api_key: str | None = None,
    served_model_name: str | None = None,
    enable_trainer_routes: bool = False,
    limits: ServerLimits | None = None,
    shutdown_timeout_s: float = 30.0,
    out: TextIO = sys.stdout,
    tool_call_parser: str = "hermes",
) -> int:
    import ray

    from forklift.dp.replica import ReplicaServer

    check_trainer_routes_exposure(host, api_key, enable_trainer_routes)
    if data_parallel_size < 1:
        raise ValueError(f"data_parallel_size must be a positive integer, got {data_parallel_size}")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per health check
    local = ray_address is None
    if local:
        cpus = max(os.cpu_count() or 1, data_parallel_size)
        ray.init(num_cpus=cpus, include_dashboard=False, configure_logging=False)
    else:
        ray.init(address=ray_address, configure_logging=False)
    name = served_model_name or default_served_name(config.model)
    kwargs = replica_engine_kwargs(config, data_parallel_size, local)
    # max_restarts=-1: Ray brings a dead replica back (its constructor runs again).
    actor_class = ray.remote(num_cpus=1, max_restarts=-1, max_task_retries=0)(ReplicaServer)
    replica_host = "127.0.0.1" if local else None
    actors = [
        actor_class.options(scheduling_strategy="SPREAD").remote(
            kwargs, name, api_key, replica_host, enable_trainer_routes, limits, tool_call_parser
        )
        for _ in range(data_parallel_size)
    ]
    frontend = Frontend(
        [RayReplicaHandle(a) for a in actors],
        Router(data_parallel_size),
        FrontendSettings(api_key=api_key, limits=limits or ServerLimits()),
    )
    app = build_frontend_app(frontend, lambda: frontend.connect_all(_STARTUP_TIMEOUT_S))
    uv_config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False)
    line = ready_line(host, port, name, api_key) + f" [{data_parallel_size} replicas]"
    try:
        DrainingServer(uv_config, line, out, frontend, shutdown_timeout_s).run()
    finally:
        ray.shutdown()
    return 0
