"""Routes that load, unload and update LoRA adapters at run time (vLLM's names), served
when the engine runs with adapters; like every /v1 route, behind the API key when one is set.
They run on the engine thread between two steps (`AsyncEngine.call`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict

from forklift.engine.engine import LLMEngine
from forklift.engine.lora_registry import LoRARegistry
from forklift.lora_request import LoRARequest
from forklift.server.admin import read_safetensors
from forklift.server.errors import APIError
from forklift.server.limits import LORA_WEIGHTS_PATH
from forklift.server.serving import ServerContext

T = TypeVar("T")


class LoadLoRAAdapter(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoRAAdapter(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str


def add_lora_routes(app: FastAPI, ctx: ServerContext) -> None:
    async_engine = ctx.async_engine

    async def on_registry(fn: Callable[[LoRARegistry, LLMEngine], T]) -> T:
        def call(engine: LLMEngine) -> T:
            assert engine.loras is not None
            return fn(engine.loras, engine)

        try:
            return await asyncio.wrap_future(async_engine.call(call))
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc

    def known(registry: LoRARegistry, name: str) -> LoRARequest:
        adapter = registry.by_name(name)
        if adapter is None:
            raise APIError(404, f"no LoRA adapter {name!r} is loaded", "lora_name",
                           code="model_not_found")  # fmt: skip
        return adapter

    @app.post("/v1/load_lora_adapter")
    async def load(body: LoadLoRAAdapter) -> dict[str, Any]:
        if body.lora_name == ctx.served_model_name:
            raise APIError(400, "lora_name is the served model's name", "lora_name")

        def add(registry: LoRARegistry, engine: LLMEngine) -> int:
            if registry.by_name(body.lora_name) is not None:
                raise ValueError(f"LoRA adapter {body.lora_name!r} is already loaded")
            request = LoRARequest(body.lora_name, registry.next_id(), body.lora_path)
            engine.add_lora(request)
            return request.lora_int_id

        adapter_id = await on_registry(add)
        return {"lora_name": body.lora_name, "lora_int_id": adapter_id, "loaded": True}

    @app.post("/v1/unload_lora_adapter")
    async def unload(body: UnloadLoRAAdapter) -> dict[str, Any]:
        def remove(registry: LoRARegistry, engine: LLMEngine) -> int:
            known(registry, body.lora_name)
            return engine.remove_lora(body.lora_name).lora_int_id

        adapter_id = await on_registry(remove)
        return {"lora_name": body.lora_name, "lora_int_id": adapter_id, "unloaded": True}

    @app.post(LORA_WEIGHTS_PATH)
    async def update(request: Request, lora_name: str) -> dict[str, Any]:
        """A safetensors payload of the adapter's PEFT-named tensors replaces its weights."""
        tensors = await read_safetensors(request)
        if not tensors:
            raise APIError(400, "the safetensors payload holds no tensors")

        def replace(registry: LoRARegistry, engine: LLMEngine) -> int:
            known(registry, lora_name)
            return engine.update_lora(lora_name, tensors)

        version = await on_registry(replace)
        return {"lora_name": lora_name, "version": version}


def adapter_models(ctx: ServerContext, created: int) -> list[dict[str, Any]]:
    """/v1/models entries of the loaded adapters (vLLM's form: `parent` is the base)."""
    loras = ctx.async_engine.loras
    if loras is None:
        return []
    return [
        {
            "id": info.name,
            "object": "model",
            "created": created,
            "owned_by": "forklift",
            "root": info.path,
            "parent": ctx.served_model_name,
        }
        for info in loras.infos()
    ]
