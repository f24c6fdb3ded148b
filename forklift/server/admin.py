"""Routes for a remote trainer: push weights, pause and resume, reset the prefix cache.

Everything runs on the engine thread between two steps (`AsyncEngine.call`), so a weight
swap never lands in the middle of a forward pass.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from fastapi import FastAPI, Request
from safetensors import SafetensorError
from safetensors.torch import load_file

from forklift.engine.engine import LLMEngine
from forklift.server.errors import APIError
from forklift.server.serving import ServerContext

T = TypeVar("T")

# Paths under the API key besides /v1/*.
ADMIN_PATHS = ("/pause", "/resume", "/is_paused", "/reset_prefix_cache", "/sleep", "/wake_up")


def add_admin_routes(app: FastAPI, ctx: ServerContext) -> None:
    async_engine = ctx.async_engine

    async def on_engine(fn: Callable[[LLMEngine], T]) -> T:
        try:
            return await asyncio.wrap_future(async_engine.call(fn))
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc

    @app.post("/v1/weights")
    async def push_weights(request: Request, finalize: bool = False) -> dict[str, Any]:
        """A safetensors payload of HF-named tensors, staged; `?finalize=true` also applies."""
        tensors = await read_safetensors(request)
        if not tensors:
            raise APIError(400, "the safetensors payload holds no tensors")

        def stage(engine: LLMEngine) -> dict[str, Any]:
            count = engine.update_weights(tensors.items(), finalize=finalize)
            key = "applied" if finalize else "staged"
            return {key: count, "weight_version": engine.weight_version}

        return await on_engine(stage)

    @app.post("/v1/weights/commit")
    async def commit_weights() -> dict[str, Any]:
        def commit(engine: LLMEngine) -> dict[str, Any]:
            if engine.num_staged_weights == 0:
                raise ValueError("no weights are staged: POST /v1/weights first")
            applied = engine.update_weights([], finalize=True)
            return {"applied": applied, "weight_version": engine.weight_version}

        return await on_engine(commit)

    @app.get("/v1/weights/version")
    async def weight_version() -> dict[str, int]:
        return {"weight_version": await on_engine(lambda engine: engine.weight_version)}

    @app.post("/pause")
    async def pause() -> dict[str, bool]:
        """Stop stepping: running requests wait (none is lost) until /resume."""
        async_engine.pause()
        return {"paused": True}

    @app.post("/resume")
    async def resume() -> dict[str, bool]:
        async_engine.resume()
        return {"paused": False}

    @app.get("/is_paused")
    async def is_paused() -> dict[str, bool]:
        return {"paused": async_engine.paused}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict[str, int]:
        return {"dropped_blocks": await on_engine(lambda engine: engine.reset_prefix_cache())}

    @app.post("/sleep")
    async def sleep(level: int = 1) -> dict[str, int]:
        await on_engine(lambda engine: engine.sleep(level))
        return {"sleep_level": level}

    @app.post("/wake_up")
    async def wake_up() -> dict[str, int]:
        await on_engine(lambda engine: engine.wake_up())
        return {"sleep_level": 0}


async def read_safetensors(request: Request) -> dict[str, torch.Tensor]:
    """The body, streamed to a temporary file (never whole in memory), then parsed off the
    event loop. Its size is bounded by `ServerLimits.max_weights_body_bytes`."""
    with tempfile.NamedTemporaryFile(prefix="forklift-weights-", suffix=".safetensors") as file:
        async for chunk in request.stream():
            file.write(chunk)
        file.flush()
        try:
            return await asyncio.to_thread(load_file, file.name)
        except (SafetensorError, ValueError, OSError) as exc:
            raise APIError(400, f"the body is not a safetensors payload: {exc}") from exc
