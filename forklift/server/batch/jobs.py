"""Batch objects (OpenAI's fields) and their state on disk, one JSON file each, rewritten
atomically at every status change so a restarted server finds each batch where it was."""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from forklift.server.errors import APIError

_BATCH_ID = re.compile(r"^batch_[0-9a-f]{32}$")

# Statuses a batch never leaves.
FINAL_STATUSES = frozenset({"completed", "failed", "cancelled", "expired"})
# When each status was entered: the Batch field that records it.
_STATUS_TIMES = {"in_progress": "in_progress_at", "finalizing": "finalizing_at",
                 "completed": "completed_at", "failed": "failed_at",
                 "cancelling": "cancelling_at", "cancelled": "cancelled_at"}  # fmt: skip


@dataclass
class RequestCounts:
    total: int = 0
    completed: int = 0
    failed: int = 0


@dataclass
class Batch:
    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    created_at: int
    # Where the answers and errors are written while the batch runs: files of the file store
    # made public (output_file_id, error_file_id) when it ends.
    answers_file_id: str
    errors_file_id: str
    status: str = "validating"
    metadata: dict[str, str] | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: list[dict[str, Any]] | None = None
    request_counts: RequestCounts = field(default_factory=RequestCounts)
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None

    @classmethod
    def new(
        cls,
        endpoint: str,
        input_file_id: str,
        completion_window: str,
        metadata: dict[str, str] | None,
        answers_file_id: str,
        errors_file_id: str,
    ) -> Batch:
        batch_id = f"batch_{uuid.uuid4().hex}"
        created = int(time.time())
        return cls(batch_id, endpoint, input_file_id, completion_window, created,
                   answers_file_id, errors_file_id, metadata=metadata)  # fmt: skip

    @property
    def finished(self) -> bool:
        return self.status in FINAL_STATUSES

    def enter(self, status: str) -> None:
        self.status = status
        if status in _STATUS_TIMES:
            setattr(self, _STATUS_TIMES[status], int(time.time()))

    def to_json(self) -> dict[str, Any]:
        """OpenAI's Batch object."""
        fields = asdict(self)
        del fields["answers_file_id"], fields["errors_file_id"]
        errors = None if self.errors is None else {"object": "list", "data": self.errors}
        return {**fields, "object": "batch", "errors": errors, "expires_at": None,
                "expired_at": None}  # fmt: skip


class BatchStore:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)

    def save(self, batch: Batch) -> None:
        path = self._path(batch.id)
        partial = path.with_name(path.name + ".partial")
        partial.write_text(json.dumps(asdict(batch)))
        os.replace(partial, path)

    def load(self, batch_id: str) -> Batch:
        try:
            fields = json.loads(self._path(batch_id).read_text())
        except FileNotFoundError:
            raise not_found(batch_id) from None
        counts = RequestCounts(**fields.pop("request_counts"))
        return Batch(**fields, request_counts=counts)

    def load_all(self) -> list[Batch]:
        """Newest first."""
        batches = [self.load(path.stem) for path in self.directory.glob("batch_*.json")]
        return sorted(batches, key=lambda b: (b.created_at, b.id), reverse=True)

    def _path(self, batch_id: str) -> Path:
        if not _BATCH_ID.match(batch_id):
            raise not_found(batch_id)
        return self.directory / f"{batch_id}.json"


def not_found(batch_id: str) -> APIError:
    return APIError(404, f"No such Batch object: {batch_id}", "batch_id")
