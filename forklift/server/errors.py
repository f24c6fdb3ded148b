"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from http import HTTPStatus
from typing import Any

from fastapi.responses import JSONResponse

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    503: "server_overloaded",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        headers: dict[str, str] | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers
        self.code = code

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.param, self.headers, self.code)

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    headers: dict[str, str] | None = None,
    code: str | None = None,
) -> JSONResponse:
    return JSONResponse(
        error_body(status, message, param, code), status_code=status, headers=headers
    )


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """`code`: OpenAI's machine-readable reason where it has one, else the status."""
    return {
        "error": {
            "message": message,
            "type": _ERROR_TYPES.get(status, "server_error"),
            "param": param,
            "code": code or status,
        }
    }


_REQUEST_PARTS = frozenset({"body", "query", "path", "header", "cookie"})


def invalid_body(errors: Sequence[Mapping[str, Any]]) -> APIError:
    """pydantic's validation errors of a request (its body or query) -> a 400 naming the
    first field."""
    first = errors[0] if errors else {}
    location = [str(p) for p in first.get("loc", ())]
    if location and location[0] in _REQUEST_PARTS:  # where FastAPI found it, not a field
        location = location[1:]
    where = ".".join(location)
    message = first.get("msg", "invalid request")
    return APIError(
        400, f"{where}: {message}" if where else message, location[0] if location else None
    )


def bad_request(exc: ValueError) -> APIError:
    """A ValueError from validation -> 400, with the field it names as `param`."""
    message = str(exc)
    match = re.search(r"SamplingParams\.(\w+)", message)
    param = match.group(1) if match else ("prompt" if "prompt" in message else None)
    param = getattr(exc, "param", None) or param  # a LimitError names its field itself
    return APIError(HTTPStatus.BAD_REQUEST, message, param)
