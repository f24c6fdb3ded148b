"""The data-parallel front end: one OpenAI-compatible address over N replica servers.

Generation requests are proxied to the replica the `Router` picks; the response says which
in the `x-forklift-replica` header. A request whose replica fails before the first byte of
its response reached the client is retried on another replica; once bytes have streamed,
the stream ends with an error event instead (the client has seen part of an answer that
cannot be resumed elsewhere). A monitor marks dead replicas down and back up when Ray has
restarted them. Trainer routes (weights, pause, sleep...) go to every replica.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from forklift.dp.router import Router, estimated_tokens, prompt_text
from forklift.server.admin import ADMIN_PATHS
from forklift.server.app import install_api_key_check
from forklift.server.body_limit import BodyLimitMiddleware
from forklift.server.errors import error_response
from forklift.server.limits import ServerLimits
from forklift.server.status.page import STATUS_JSON_PATH, status_page

logger = logging.getLogger("forklift")

_GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions")
# Trainer routes: applied on every replica so they stay interchangeable.
_BROADCAST_POSTS = (*ADMIN_PATHS, "/v1/weights", "/v1/weights/commit")
_HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "content-encoding"}


class ReplicaHandle(Protocol):
    """How the front end reaches a replica's control plane (a Ray actor in production)."""

    async def url(self) -> str: ...

    async def pid(self) -> int: ...


@dataclass
class FrontendSettings:
    api_key: str | None = None
    health_interval_s: float = 1.0
    request_timeout_s: float = 3600.0
    # The same body limits as a single server: the front end reads each body before proxying.
    limits: ServerLimits = dataclasses.field(default_factory=ServerLimits)


class _ReplicaFailed(Exception):
    pass


class Frontend:
    def __init__(
        self, replicas: list[ReplicaHandle], router: Router, settings: FrontendSettings
    ) -> None:
        self.handles = replicas
        self.router = router
        self.settings = settings
        self.pids: dict[int, int] = {}
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(settings.request_timeout_s))
        self._monitor: asyncio.Task[None] | None = None
        self.accepting = True

    # ---- graceful shutdown (see forklift/server/shutdown.py) ------------------------------
    def stop_accepting(self) -> None:
        self.accepting = False

    def is_idle(self) -> bool:
        return all(r.outstanding_requests == 0 for r in self.router.replicas)

    def failure(self) -> BaseException | None:
        return None  # replicas that die are restarted by Ray

    def abort_all(self) -> int:
        # Proxied requests are aborted on their replicas when uvicorn closes their
        # connections, after its own graceful timeout.
        return sum(r.outstanding_requests for r in self.router.replicas)

    # ---- replica health -----------------------------------------------------------------
    async def connect_all(self, timeout_s: float) -> None:
        await asyncio.wait_for(
            asyncio.gather(*(self._bring_up(i) for i in range(len(self.handles)))), timeout_s
        )

    async def _bring_up(self, index: int) -> bool:
        handle = self.handles[index]
        url = await handle.url()
        response = await self.client.get(f"{url}/health", timeout=5)
        if response.status_code != 200:
            return False
        self.pids[index] = await handle.pid()
        self.router.mark_up(index, url)
        logger.info("replica %d up at %s", index, url)
        return True

    def start_monitor(self) -> None:
        self._monitor = asyncio.create_task(self._monitor_loop())

    async def _monitor_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.health_interval_s)
            await asyncio.gather(*(self._check(r.index) for r in self.router.replicas))

    async def _check(self, index: int) -> None:
        replica = self.router.replicas[index]
        try:
            if replica.healthy:
                response = await self.client.get(f"{replica.url}/health", timeout=5)
                if response.status_code != 200:
                    raise _ReplicaFailed(f"health {response.status_code}")
            else:
                await asyncio.wait_for(self._bring_up(index), self.settings.health_interval_s * 5)
        except (httpx.HTTPError, _ReplicaFailed, asyncio.TimeoutError, OSError) as exc:
            if replica.healthy:
                logger.warning("replica %d is down: %s", index, exc)
                self.router.mark_down(index)
        except Exception as exc:  # a Ray error while the actor restarts
            if replica.healthy:
                self.router.mark_down(index)
            logger.debug("replica %d not back yet: %s", index, exc)

    async def close(self) -> None:
        if self._monitor is not None:
            self._monitor.cancel()
        await self.client.aclose()

    # ---- proxying -----------------------------------------------------------------------
    async def generate(self, path: str, body: bytes, headers: dict[str, str]) -> Response:
        if not self.accepting:
            return error_response(503, "the server is shutting down and takes no new requests")
        try:
            payload = json.loads(body)
        except ValueError:
            payload = None
        text = prompt_text(payload)
        key = self.router.prefix_key(text)
        tokens = estimated_tokens(payload, text)
        streaming = isinstance(payload, dict) and payload.get("stream") is True
        tried: set[int] = set()
        while True:
            index = self.router.choose(key, tried)
            if index is None:
                return _no_replica()
            tried.add(index)
            self.router.acquire(index, tokens)
            try:
                return await self._forward(index, path, body, headers, streaming, tokens)
            except _ReplicaFailed as exc:
                self.router.release(index, tokens)
                logger.warning("replica %d failed before responding (%s); retrying", index, exc)
                self.router.mark_down(index)

    async def _forward(
        self,
        index: int,
        path: str,
        body: bytes,
        headers: dict[str, str],
        streaming: bool,
        tokens: int,
    ) -> Response:
        """Raises _ReplicaFailed while nothing has been sent to the client yet."""
        url = self.router.replicas[index].url
        request = self.client.build_request("POST", f"{url}{path}", content=body, headers=headers)
        try:
            upstream = await self.client.send(request, stream=True)
        except httpx.TransportError as exc:
            raise _ReplicaFailed(str(exc)) from exc
        out_headers = _response_headers(upstream, index)
        if not streaming or upstream.status_code != 200:
            try:
                content = await upstream.aread()
            except httpx.TransportError as exc:
                raise _ReplicaFailed(str(exc)) from exc
            finally:
                await upstream.aclose()
            self.router.release(index, tokens)
            return Response(content, upstream.status_code, out_headers)
        chunks = upstream.aiter_raw()
        try:
            first = await chunks.__anext__()
        except StopAsyncIteration:
            first = b""
        except httpx.TransportError as exc:
            await upstream.aclose()
            raise _ReplicaFailed(str(exc)) from exc
        return StreamingResponse(
            self._relay(index, tokens, upstream, first, chunks),
            upstream.status_code,
            out_headers,
        )

    async def _relay(
        self,
        index: int,
        tokens: int,
        upstream: httpx.Response,
        first: bytes,
        chunks: AsyncIterator[bytes],
    ) -> AsyncIterator[bytes]:
        try:
            yield first
            async for chunk in chunks:
                yield chunk
        except httpx.TransportError as exc:
            logger.warning("replica %d failed mid-stream: %s", index, exc)
            self.router.mark_down(index)
            error = {
                "error": {
                    "message": f"replica {index} failed mid-stream; retry the request",
                    "type": "server_error",
                    "param": None,
                    "code": 502,
                }
            }
            yield f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()
        finally:
            self.router.release(index, tokens)
            await upstream.aclose()

    async def forward_any(self, method: str, path: str, body: bytes, headers: dict[str, str]):
        for replica in sorted(self.router.replicas, key=lambda r: r.outstanding_tokens):
            if not replica.healthy:
                continue
            try:
                upstream = await self.client.request(
                    method, f"{replica.url}{path}", content=body, headers=headers
                )
            except httpx.TransportError:
                continue
            return Response(
                upstream.content, upstream.status_code, _response_headers(upstream, replica.index)
            )
        return _no_replica()

    async def broadcast(self, path: str, query: str, body: bytes, headers: dict[str, str]):
        """POST to every healthy replica; the first failure (or the first answer) wins."""
        targets = [r for r in self.router.replicas if r.healthy]
        if not targets:
            return _no_replica()
        suffix = f"?{query}" if query else ""
        answers = await asyncio.gather(
            *(
                self.client.post(f"{r.url}{path}{suffix}", content=body, headers=headers)
                for r in targets
            ),
            return_exceptions=True,
        )
        for replica, answer in zip(targets, answers, strict=True):
            if isinstance(answer, BaseException):
                return error_response(502, f"replica {replica.index} failed: {answer}")
            if answer.status_code >= 400:
                return Response(answer.content, answer.status_code, _response_headers(answer))
        first = answers[0]
        assert isinstance(first, httpx.Response)
        return Response(first.content, first.status_code, _response_headers(first))

    # ---- introspection ------------------------------------------------------------------
    def replica_table(self) -> list[dict[str, Any]]:
        return [
            {
                "index": r.index,
                "url": r.url,
                "pid": self.pids.get(r.index),
                "healthy": r.healthy,
                "outstanding_requests": r.outstanding_requests,
                "outstanding_tokens": r.outstanding_tokens,
                "routed_total": r.routed_total,
                "failures_total": r.failures_total,
                "restarts_total": r.restarts_total,
            }
            for r in self.router.replicas
        ]

    async def status(self, headers: dict[str, str]) -> dict[str, Any]:
        """Every replica's status snapshot, one entry each (a down one says why)."""

        async def one(replica: Any) -> dict[str, Any]:
            entry = {"index": replica.index, "url": replica.url, "healthy": replica.healthy}
            if not replica.url:
                return {**entry, "status": None, "error": "not started"}
            try:
                answer = await self.client.get(
                    f"{replica.url}{STATUS_JSON_PATH}", headers=headers, timeout=5.0
                )
            except httpx.HTTPError as exc:
                return {**entry, "status": None, "error": f"unreachable: {exc}"}
            if answer.status_code != 200:
                return {**entry, "status": None, "error": f"HTTP {answer.status_code}"}
            try:
                return {**entry, "status": answer.json(), "error": None}
            except ValueError:
                return {**entry, "status": None, "error": "the replica's answer is not JSON"}

        replicas = await asyncio.gather(*(one(r) for r in self.router.replicas))
        return {"replicas": list(replicas)}

    def metrics_text(self) -> str:
        series = {
            "replica_healthy": ("gauge", "1 while the replica answers", "healthy"),
            "replica_outstanding_requests": ("gauge", "requests sent, not finished",
                                             "outstanding_requests"),
            "replica_outstanding_tokens": ("gauge", "estimated tokens of those requests",
                                           "outstanding_tokens"),
            "replica_routed_requests_total": ("counter", "requests routed", "routed_total"),
            "replica_failures_total": ("counter", "times marked down", "failures_total"),
            "replica_restarts_total": ("counter", "times back after a failure",
                                       "restarts_total"),
        }  # fmt: skip
        lines = []
        table = self.replica_table()
        for name, (kind, help_text, field) in series.items():
            lines += [f"# HELP forklift:{name} {help_text}", f"# TYPE forklift:{name} {kind}"]
            for row in table:
                lines.append(f'forklift:{name}{{replica="{row["index"]}"}} {int(row[field])}')
        return "\n".join(lines) + "\n"


def _no_replica() -> Response:
    return error_response(503, "no replica is available; try again shortly")


def _response_headers(upstream: httpx.Response, index: int | None = None) -> dict[str, str]:
    headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_HEADERS}
    if index is not None:
        headers["x-forklift-replica"] = str(index)
    return headers


def _forwarded_headers(request: Request) -> dict[str, str]:
    keep = ("authorization", "content-type", "accept")
    return {k: v for k, v in request.headers.items() if k.lower() in keep}


def build_frontend_app(frontend: Frontend, startup: Callable[[], Awaitable[None]]) -> FastAPI:
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await startup()
        frontend.start_monitor()
        yield
        await frontend.close()

    app = FastAPI(title="forklift data-parallel front end", lifespan=lifespan)
    app.add_middleware(BodyLimitMiddleware, limit_for=frontend.settings.limits.body_limit)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> Response:
        return error_response(exc.status_code, str(exc.detail))

    if frontend.settings.api_key is not None:
        install_api_key_check(app, frontend.settings.api_key)

    @app.get("/health")
    async def health() -> Response:
        up = frontend.accepting and any(r.healthy for r in frontend.router.replicas)
        return Response(status_code=200 if up else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(frontend.metrics_text(), media_type="text/plain; version=0.0.4")

    @app.get("/status", include_in_schema=False)
    async def status_html() -> Response:
        return Response(status_page(), media_type="text/html; charset=utf-8")

    @app.get(STATUS_JSON_PATH)
    async def status_json(request: Request) -> dict[str, Any]:
        return await frontend.status(_forwarded_headers(request))

    @app.get("/v1/replicas")
    async def replicas() -> dict[str, Any]:
        return {"object": "list", "data": frontend.replica_table()}

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def proxy(path: str, request: Request) -> Response:
        full = "/" + path
        body = await request.body()
        headers = _forwarded_headers(request)
        if request.method == "POST" and full in _GENERATE_PATHS:
            return await frontend.generate(full, body, headers)
        if request.method == "POST" and full in _BROADCAST_POSTS:
            return await frontend.broadcast(full, request.url.query, body, headers)
        suffix = f"?{request.url.query}" if request.url.query else ""
        return await frontend.forward_any(request.method, full + suffix, body, headers)

    return app
