"""Limits of the HTTP layer: body bytes, prompts per request, fields the engine never sees.

The engine's own per-request limits (n, logprobs, stop strings, stop_token_ids) are
EngineConfig fields, checked by `core/input_processor.py`; these are the server's.
"""

from __future__ import annotations

from dataclasses import dataclass

from forklift.config import EngineConfig
from forklift.server.errors import APIError

WEIGHTS_PATH = "/v1/weights"
FILES_PATH = "/v1/files"
LORA_WEIGHTS_PATH = "/v1/update_lora_adapter"


@dataclass(frozen=True)
class ServerLimits:
    # Bytes of a request body (JSON); a bigger one is a 413 before it is parsed.
    max_body_bytes: int = 8 * 2**20
    # Bytes of a `POST /v1/weights` (or /v1/update_lora_adapter) safetensors body, streamed
    # to a temporary file.
    max_weights_body_bytes: int = 16 * 2**30
    # Bytes of a `POST /v1/files` upload (a batch input file; OpenAI's limit is 200 MB).
    max_file_bytes: int = 200 * 2**20
    # Prompts in one /v1/completions request (each becomes a request of its own).
    max_prompts_per_request: int = 128
    # Entries of `logit_bias` (OpenAI's own limit is 300).
    max_logit_bias: int = 300

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_weights_body_bytes", "max_file_bytes",
                     "max_prompts_per_request", "max_logit_bias"):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    def body_limit(self, path: str) -> int:
        if path in (WEIGHTS_PATH, LORA_WEIGHTS_PATH):
            return self.max_weights_body_bytes
        return self.max_file_bytes if path == FILES_PATH else self.max_body_bytes


def at_most(field: str, count: int, limit: int, limit_name: str) -> None:
    """400 naming the field and the limit when a client-sized count is over it."""
    if count > limit:
        raise APIError(
            400, f"{field} has {count} entries, more than the limit {limit_name}={limit}", field
        )


def check_extra_fields(
    extra: dict[str, object], limits: ServerLimits, config: EngineConfig
) -> None:
    """Fields forklift accepts but does not act on must still be bounded."""
    best_of = extra.get("best_of")
    if isinstance(best_of, int) and best_of > config.max_n:
        raise APIError(
            400, f"best_of is {best_of}, more than the limit max_n={config.max_n}", "best_of"
        )
