"""The FastAPI application: routes, API-key check, errors in OpenAI's shape."""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from forklift.engine.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineDrainingError,
    EngineOverloadedError,
)
from forklift.engine.engine import LLMEngine
from forklift.server.admin import ADMIN_PATHS, add_admin_routes
from forklift.server.batch.routes import add_batch_routes
from forklift.server.batch.service import BatchService
from forklift.server.body_limit import BodyLimitMiddleware
from forklift.server.chat import chat_prompt_ids, create_chat_completion
from forklift.server.completions import create_completion
from forklift.server.errors import APIError, error_response, invalid_body
from forklift.server.limits import ServerLimits
from forklift.server.lora_routes import adapter_models, add_lora_routes
from forklift.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from forklift.server.responses.body import ResponsesRequest
from forklift.server.responses.handlers import create_response, delete_response, retrieve_response
from forklift.server.responses.store import ResponseStore
from forklift.server.serving import ServerContext
from forklift.server.status.metrics import ServerMetrics
from forklift.server.status.page import (
    FIRST_TOKEN_JSON_PATH,
    STATUS_JSON_PATH,
    SnapshotSource,
    add_status_routes,
)
from forklift.server.tokenizer_info import tokenizer_info
from forklift.server.tools.parsers import make_parser
from forklift.version import __version__


def build_app(
    engine: LLMEngine,
    served_model_name: str,
    api_key: str | None = None,
    max_waiting_requests: int | None = None,
    limits: ServerLimits | None = None,
    enable_trainer_routes: bool = False,
    tool_call_parser: str = "hermes",
    engine_thread: bool = True,
    batch_dir: Path | None = None,
) -> FastAPI:
    """The app; trainer routes (weights, pause, sleep, prefix-cache reset) only on request;
    /v1/files and /v1/batches with a `batch_dir` to keep their files and state in.

    `engine_thread=False`: the engine loop is not started; the caller runs
    `app.state.ctx.async_engine.run_here()` (see `forklift.server.run_server`)."""
    make_parser(tool_call_parser)  # a bad name fails here, not on the first tool request
    metrics = ServerMetrics()
    async_engine = AsyncEngine(
        engine, max_waiting_requests, on_step=metrics.observe_step, start_thread=engine_thread
    )
    limits = limits or ServerLimits()
    ctx = ServerContext(async_engine, served_model_name, limits, tool_call_parser)
    batches = BatchService(ctx, batch_dir) if batch_dir is not None else None

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if batches is not None:
            await batches.start()  # resumes the batches a stopped server left running
        yield
        if batches is not None:
            await batches.stop()
        async_engine.shutdown()

    app = FastAPI(title="forklift", version=__version__, lifespan=lifespan)
    app.state.ctx = ctx
    app.state.metrics = metrics
    # Responses kept for previous_response_id and GET / DELETE /v1/responses/{id}.
    app.state.responses = ResponseStore()
    _install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, limit_for=limits.body_limit)
    if api_key is not None:
        install_api_key_check(app, api_key)
    _add_routes(app, ctx, metrics)
    add_batch_routes(app, batches)
    app.state.status = SnapshotSource(async_engine, metrics.history, served_model_name)
    add_status_routes(app, app.state.status)
    if enable_trainer_routes:
        add_admin_routes(app, ctx)
    if async_engine.loras is not None:
        add_lora_routes(app, ctx)
    return app


def _add_routes(app: FastAPI, ctx: ServerContext, metrics: ServerMetrics) -> None:
    engine = ctx.async_engine

    def respond(result: Response | None) -> Response:
        # None: the client left, so nobody reads this; 499 is the conventional status.
        return result if result is not None else Response(status_code=499)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return respond(await create_completion(ctx, body, request.is_disconnected))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return respond(await create_chat_completion(ctx, body, request.is_disconnected))

    store: ResponseStore = app.state.responses

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        return respond(await create_response(ctx, store, body, request.is_disconnected))

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, request: Request) -> dict[str, Any]:
        return retrieve_response(store, response_id, request.query_params)

    @app.delete("/v1/responses/{response_id}")
    async def remove_response(response_id: str) -> dict[str, Any]:
        return delete_response(store, response_id)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": ctx.served_model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "forklift",
                    "max_model_len": engine.max_model_len,
                },
                *adapter_models(ctx, 0),
            ],
        }

    @app.get("/health")
    async def health() -> Response:
        # 503 while shutting down, so a load balancer stops sending requests here.
        return Response(status_code=200 if ctx.async_engine.accepting else 503)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        ctx.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", "prompt")
        tokenizer = ctx.tokenizer
        if body.messages is not None:
            tokens = await asyncio.to_thread(
                chat_prompt_ids, ctx, body.messages, body.add_generation_prompt
            )
        else:
            text = body.prompt or ""
            tokens = await asyncio.to_thread(tokenizer.encode, text, body.add_special_tokens)
        pieces = tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None
        return {
            "count": len(tokens),
            "max_model_len": engine.max_model_len,
            "tokens": tokens,
            "token_strs": pieces,
        }

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, str]:
        ctx.check_model(body.model)
        vocab = engine.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary [0, {vocab})", "tokens")
        return {"prompt": ctx.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    @app.get("/tokenizer_info")
    async def get_tokenizer_info() -> dict[str, Any]:
        return tokenizer_info(ctx.tokenizer, engine.max_model_len)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_request_body(_: Request, exc: RequestValidationError) -> JSONResponse:
        return invalid_body(exc.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(EngineOverloadedError)
    async def overloaded(_: Request, exc: EngineOverloadedError) -> JSONResponse:
        return error_response(503, str(exc), headers={"Retry-After": "1"})

    @app.exception_handler(EngineDrainingError)
    async def draining(_: Request, exc: EngineDrainingError) -> JSONResponse:
        return error_response(503, str(exc))

    @app.exception_handler(EngineDeadError)
    async def dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        # The server exits (non-zero) at its next tick; until then the service is gone.
        return error_response(503, str(exc))


def install_api_key_check(app: FastAPI, api_key: str) -> None:
    expected = f"Bearer {api_key}".encode()

    @app.middleware("http")
    async def check_key(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        path = request.url.path
        if (
            path.startswith("/v1")
            or path in ADMIN_PATHS
            or path in (STATUS_JSON_PATH, FIRST_TOKEN_JSON_PATH)
        ):
            given = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                return error_response(401, "invalid API key")
        return await call_next(request)
