"""The files of /v1/files on disk: `<id>` holds the content, `<id>.json` its description.

A file exists once its description is written (last, atomically): an upload cut short or a
batch output still being written is never listed."""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from forklift.server.errors import APIError

_FILE_ID = re.compile(r"^file-[0-9a-f]{32}$")


@dataclass(frozen=True)
class StoredFile:
    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "object": "file", "status": "processed", "expires_at": None,
                "status_details": None}  # fmt: skip


class FileStore:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)

    @staticmethod
    def new_id() -> str:
        return f"file-{uuid.uuid4().hex}"

    def content_path(self, file_id: str) -> Path:
        """Where a file's content is (or will be); a malformed id is a 404, so no id can
        name a path outside the store."""
        if not _FILE_ID.match(file_id):
            raise _not_found(file_id)
        return self.directory / file_id

    def add(self, content: bytes, filename: str, purpose: str) -> StoredFile:
        file_id = self.new_id()
        partial = self.directory / f"{file_id}.partial"
        partial.write_bytes(content)
        os.replace(partial, self.content_path(file_id))
        return self.publish(file_id, filename, purpose)

    def publish(self, file_id: str, filename: str, purpose: str) -> StoredFile:
        """Make the content already at `content_path(file_id)` a file (again: idempotent)."""
        path = self.content_path(file_id)
        path.touch()
        stored = StoredFile(file_id, path.stat().st_size, int(time.time()), filename, purpose)
        _write_atomically(self._description(file_id), json.dumps(asdict(stored)))
        return stored

    def get(self, file_id: str) -> StoredFile:
        self.content_path(file_id)  # checks the id
        try:
            return StoredFile(**json.loads(self._description(file_id).read_text()))
        except FileNotFoundError:
            raise _not_found(file_id) from None

    def list(self, purpose: str | None = None) -> list[StoredFile]:
        """Newest first."""
        files = []
        for description in self.directory.glob("file-*.json"):
            try:
                stored = self.get(description.stem)
            except APIError:  # deleted since the directory was read
                continue
            if purpose is None or stored.purpose == purpose:
                files.append(stored)
        return sorted(files, key=lambda f: (f.created_at, f.id), reverse=True)

    def delete(self, file_id: str) -> None:
        self.get(file_id)
        self._description(file_id).unlink()
        self.content_path(file_id).unlink(missing_ok=True)

    def _description(self, file_id: str) -> Path:
        return self.directory / f"{file_id}.json"


def _write_atomically(path: Path, text: str) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)


def _not_found(file_id: str) -> APIError:
    return APIError(404, f"No such File object: {file_id}", "file_id")
