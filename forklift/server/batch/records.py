"""OpenAI's batch JSONL: input lines -> requests (or why a line is bad), answers -> output
records, and the key that matches a record to its line when a run resumes."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from forklift.server.endpoints import GENERATION_ENDPOINTS, EndpointAnswer
from forklift.server.errors import APIError

# A custom_id, or the line number of a line that has none (it is malformed).
RecordKey = str | int

# Errors of lines without a custom_id start with their line number: the record's key.
_LINE_PREFIX = re.compile(r"^line (\d+): ")


@dataclass(frozen=True)
class BatchRequest:
    line: int
    custom_id: str
    url: str
    body: Any  # validated by the endpoint, as an HTTP body is

    @property
    def key(self) -> RecordKey:
        return self.custom_id


@dataclass(frozen=True)
class BadLine:
    line: int
    custom_id: str | None
    error: APIError

    @property
    def key(self) -> RecordKey:
        return self.custom_id if self.custom_id is not None else self.line


BatchLine = BatchRequest | BadLine


def parse_line(number: int, text: str, endpoint: str | None = None) -> BatchLine:
    """One input line; `endpoint`: the url every line must name (a server batch's)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        return _bad(number, None, f"not valid JSON ({exc})", None)
    except RecursionError:  # "[[[[..." deeper than the parser goes
        return _bad(number, None, "not valid JSON (nested too deeply)", None)
    if not isinstance(data, dict):
        return _bad(number, None, "a line must be a JSON object", None)
    custom_id = data.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return _bad(number, None, "custom_id must be a non-empty string", "custom_id")
    method = data.get("method")
    if method != "POST":
        return _bad(number, custom_id, f"method must be 'POST', got {method!r}", "method")
    url = data.get("url")
    if url not in GENERATION_ENDPOINTS:
        known = ", ".join(GENERATION_ENDPOINTS)
        return _bad(number, custom_id, f"url must be one of {known}, got {url!r}", "url")
    if endpoint is not None and url != endpoint:
        message = f"url {url!r} differs from the batch's endpoint {endpoint!r}"
        return _bad(number, custom_id, message, "url")
    body = data.get("body")
    if not isinstance(body, dict):
        return _bad(number, custom_id, "body must be a JSON object", "body")
    return BatchRequest(number, custom_id, url, body)


def read_batch(lines: Iterable[str], endpoint: str | None = None) -> list[BatchLine]:
    """Every non-blank line, numbered from 1. A custom_id used twice is a ValueError naming
    both lines: a resumed run matches finished lines by it."""
    items: list[BatchLine] = []
    first_line: dict[str, int] = {}
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        item = parse_line(number, text, endpoint)
        if item.custom_id is not None:
            earlier = first_line.setdefault(item.custom_id, number)
            if earlier != number:
                raise ValueError(
                    f"line {number}: custom_id {item.custom_id!r} is also on line {earlier}; "
                    "each line needs its own"
                )
        items.append(item)
    return items


def _bad(number: int, custom_id: str | None, message: str, param: str | None) -> BadLine:
    return BadLine(number, custom_id, APIError(400, f"line {number}: {message}", param))


def answer_record(custom_id: str | None, answer: EndpointAnswer) -> dict[str, Any]:
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": {
            "status_code": answer.status_code,
            "request_id": answer.request_id,
            "body": answer.body,
        },
        "error": None,
    }


def bad_line_record(bad: BadLine) -> dict[str, Any]:
    answer = EndpointAnswer(bad.error.status, f"req-{uuid.uuid4().hex}", bad.error.body())
    return answer_record(bad.custom_id, answer)


def is_failure(record: dict[str, Any]) -> bool:
    response = record.get("response") or {}
    return response.get("status_code") != 200


def output_tokens(record: dict[str, Any]) -> int:
    body = (record.get("response") or {}).get("body") or {}
    return int((body.get("usage") or {}).get("completion_tokens") or 0)


def record_key(record: Any) -> RecordKey:
    """The key of a written record; a ValueError if it is no batch record."""
    if not isinstance(record, dict) or "custom_id" not in record:
        raise ValueError("not a batch output record")
    if isinstance(record["custom_id"], str):
        return record["custom_id"]
    message = (((record.get("response") or {}).get("body") or {}).get("error") or {}).get(
        "message", ""
    )
    match = _LINE_PREFIX.match(message)
    if match is None:
        raise ValueError("a record without custom_id must name its line")
    return int(match.group(1))
