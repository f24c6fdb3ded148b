"""/v1/files and /v1/batches (OpenAI's), or, without --batch-dir, an error saying how to
turn them on."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse
from pydantic import BaseModel

from forklift.server.batch.multipart import parse_form
from forklift.server.batch.service import BATCH_PURPOSE, BatchService
from forklift.server.errors import APIError
from forklift.server.limits import FILES_PATH

BATCHES_PATH = "/v1/batches"
_MAX_PAGE = 10_000


class CreateBatchRequest(BaseModel):
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None


def add_batch_routes(app: FastAPI, service: BatchService | None) -> None:
    if service is None:
        _add_disabled_routes(app)
        return
    files = service.files

    @app.post(FILES_PATH)
    async def upload_file(request: Request) -> dict[str, Any]:
        form = parse_form(request.headers.get("content-type", ""), await request.body())
        purpose = form.get("purpose")
        if purpose is None or purpose.content.decode("utf-8", "replace") != BATCH_PURPOSE:
            raise APIError(400, "purpose must be 'batch': files here are batch inputs", "purpose")
        upload = form.get("file")
        if upload is None:
            raise APIError(400, "the form has no 'file' field", "file")
        filename = upload.filename or "upload.jsonl"
        stored = await asyncio.to_thread(files.add, upload.content, filename, BATCH_PURPOSE)
        return stored.to_json()

    @app.get(FILES_PATH)
    async def list_files(
        purpose: str | None = None, limit: int = _MAX_PAGE, after: str | None = None,
        order: str = "desc",
    ) -> dict[str, Any]:  # fmt: skip
        listed = files.list(purpose)
        if order not in ("asc", "desc"):
            raise APIError(400, f"order must be 'asc' or 'desc', got {order!r}", "order")
        if order == "asc":
            listed.reverse()
        return _page([f.to_json() for f in listed], after, limit)

    @app.get(FILES_PATH + "/{file_id}")
    async def retrieve_file(file_id: str) -> dict[str, Any]:
        return files.get(file_id).to_json()

    @app.get(FILES_PATH + "/{file_id}/content")
    async def file_content(file_id: str) -> FileResponse:
        stored = files.get(file_id)
        return FileResponse(files.content_path(file_id), media_type="application/jsonl",
                            filename=stored.filename)  # fmt: skip

    @app.delete(FILES_PATH + "/{file_id}")
    async def delete_file(file_id: str) -> dict[str, Any]:
        files.get(file_id)
        batch = service.using(file_id)
        if batch is not None:
            message = f"file {file_id} belongs to batch {batch.id}, which is {batch.status}"
            raise APIError(409, message, "file_id")
        files.delete(file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    @app.post(BATCHES_PATH)
    async def create_batch(body: CreateBatchRequest) -> dict[str, Any]:
        batch = service.create(
            body.input_file_id, body.endpoint, body.completion_window, body.metadata
        )
        return batch.to_json()

    @app.get(BATCHES_PATH)
    async def list_batches(limit: int = 20, after: str | None = None) -> dict[str, Any]:
        return _page([b.to_json() for b in service.list()], after, limit)

    @app.get(BATCHES_PATH + "/{batch_id}")
    async def retrieve_batch(batch_id: str) -> dict[str, Any]:
        return service.get(batch_id).to_json()

    @app.post(BATCHES_PATH + "/{batch_id}/cancel")
    async def cancel_batch(batch_id: str) -> dict[str, Any]:
        return service.cancel(batch_id).to_json()


def _page(items: Sequence[dict[str, Any]], after: str | None, limit: int) -> dict[str, Any]:
    """OpenAI's cursor page: the `limit` items after the one whose id is `after`."""
    if not 1 <= limit <= _MAX_PAGE:
        raise APIError(400, f"limit must be in [1, {_MAX_PAGE}], got {limit}", "limit")
    start = 0
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise APIError(400, f"after: no object {after!r} in this list", "after")
        start = ids.index(after) + 1
    data = list(items[start : start + limit])
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": start + limit < len(items),
    }


def _add_disabled_routes(app: FastAPI) -> None:
    message = (
        "files and batches are off on this server: start it with --batch-dir DIR (a "
        "directory where uploaded files, batch state and results are kept) to enable "
        "/v1/files and /v1/batches"
    )

    async def disabled() -> None:
        raise APIError(404, message, code="batches_disabled")

    methods = ["GET", "POST", "DELETE"]
    for path in (FILES_PATH, BATCHES_PATH):
        app.add_api_route(path, disabled, methods=methods, include_in_schema=False)
        app.add_api_route(path + "/{rest:path}", disabled, methods=methods,
                          include_in_schema=False)  # fmt: skip
