"""Output JSONL that only grows: each record one flushed line, appended as its request
finishes, so a run killed at any point keeps every finished answer and can resume."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from forklift.server.batch.records import RecordKey, is_failure, record_key


@dataclass
class FinishedRecords:
    """What an output file already holds."""

    keys: set[RecordKey] = field(default_factory=set)
    completed: int = 0
    failed: int = 0

    def add(self, record: dict[str, Any]) -> None:
        self.keys.add(record_key(record))
        if is_failure(record):
            self.failed += 1
        else:
            self.completed += 1


def read_finished(path: Path, into: FinishedRecords | None = None) -> FinishedRecords:
    """The records in `path` (none if it does not exist). A torn last line, left by a run
    killed mid-write, is cut off first; any other line that is no record is a ValueError,
    as appending to a file that is not ours would mix two things."""
    finished = into if into is not None else FinishedRecords()
    if not path.exists():
        return finished
    data = path.read_bytes()
    whole_end = data.rfind(b"\n") + 1
    tail = data[whole_end:]
    if tail.strip():
        if _parses(tail):  # whole, only its newline missing
            with path.open("ab") as out:
                out.write(b"\n")
            data += b"\n"
        else:
            with path.open("rb+") as out:
                out.truncate(whole_end)
            data = data[:whole_end]
    for number, line in enumerate(data.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            finished.add(json.loads(line))
        except ValueError as exc:
            raise ValueError(f"{path}: line {number} is not a batch output record ({exc})") from exc
    return finished


def _parses(line: bytes) -> bool:
    try:
        record_key(json.loads(line))
    except ValueError:
        return False
    return True


class RecordWriter:
    """Appends records to a JSONL file; never rewrites a line."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a", encoding="utf-8")

    def append(self, record: dict[str, Any]) -> None:
        # One write per line, flushed at once: the OS holds it even if the process dies next.
        self._file.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()
