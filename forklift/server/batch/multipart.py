"""multipart/form-data bodies (file uploads), read with the standard library's MIME parser."""

from __future__ import annotations

from dataclasses import dataclass
from email import policy
from email.parser import BytesParser

from forklift.server.errors import APIError


@dataclass(frozen=True)
class FormPart:
    filename: str | None
    content: bytes


def parse_form(content_type: str, body: bytes) -> dict[str, FormPart]:
    """The body's parts by field name; a body that is no multipart form is a 400."""
    if not content_type.lower().startswith("multipart/form-data"):
        raise APIError(400, f"expected a multipart/form-data body, got {content_type!r}")
    header = f"Content-Type: {content_type}\r\nMIME-Version: 1.0\r\n\r\n".encode("latin-1")
    message = BytesParser(policy=policy.HTTP).parsebytes(header + body)
    if not message.is_multipart() or message.defects:
        raise APIError(400, "the multipart/form-data body is malformed")
    parts = {}
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if isinstance(name, str):
            content = part.get_payload(decode=True)
            parts[name] = FormPart(
                part.get_filename(), content if isinstance(content, bytes) else b""
            )
    return parts
