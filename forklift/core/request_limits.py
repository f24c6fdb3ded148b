"""Per-request size limits: every size a caller controls is bounded before it is queued.

A request over a limit raises `LimitError`, a ValueError that names the field and the
limit, so the offline API and the server (HTTP 400, `param` = the field) report it alike.
"""

from __future__ import annotations

from forklift.config import EngineConfig
from forklift.sampling_params import SamplingParams


class LimitError(ValueError):
    """A request field over its limit; `param` is the field's name in the request."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def check_sampling_limits(params: SamplingParams, config: EngineConfig, vocab_size: int) -> None:
    """Raise LimitError for the first field of `params` over its limit in `config`."""
    _at_most("n", params.n, config.max_n, "max_n")
    for field in ("logprobs", "prompt_logprobs"):
        count = getattr(params, field)
        if count is None:
            continue
        _at_most(field, count, config.max_logprobs, "max_logprobs")
        if count > vocab_size:
            raise LimitError(
                f"SamplingParams.{field} is {count}, more than the vocabulary "
                f"({vocab_size} tokens)",
                field,
            )
    _at_most("stop", len(params.stop), config.max_stop_strings, "max_stop_strings", "entries")
    longest = max((len(s) for s in params.stop), default=0)
    _at_most("stop", longest, config.max_stop_string_chars, "max_stop_string_chars", "chars")
    _at_most(
        "stop_token_ids",
        len(params.stop_token_ids),
        config.max_stop_token_ids,
        "max_stop_token_ids",
        "entries",
    )
    # The sampler masks with these ids on every step, and the scan below reads each: no
    # more entries than the vocabulary (checked first, since it is cheap).
    allowed = params.allowed_token_ids
    if allowed is not None and len(allowed) > vocab_size:
        raise LimitError(
            f"SamplingParams.allowed_token_ids has {len(allowed)} entries, more than the "
            f"vocabulary ({vocab_size} tokens)",
            "allowed_token_ids",
        )
    for field, ids in (
        ("stop_token_ids", params.stop_token_ids),
        ("logit_bias", list(params.logit_bias or ())),
        ("allowed_token_ids", params.allowed_token_ids or ()),
    ):
        bad = next((t for t in ids if t >= vocab_size), None)
        if bad is not None:
            raise LimitError(
                f"SamplingParams.{field} holds {bad}, outside the vocabulary [0, {vocab_size})",
                field,
            )
    _at_most("bad_words", len(params.bad_words or ()), config.max_stop_strings,
             "max_stop_strings", "entries")  # fmt: skip


def check_context_length(
    num_prompt_tokens: int, max_tokens: int | None, max_model_len: int
) -> None:
    """vLLM's rule for the server: prompt plus max_tokens must fit in max_model_len.

    (The offline engine instead stops such a request at max_model_len, as vLLM's does.)"""
    if max_tokens is None or num_prompt_tokens + max_tokens <= max_model_len:
        return
    raise LimitError(
        f"This model's maximum context length is {max_model_len} tokens. However, you "
        f"requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the "
        f"messages, {max_tokens} in the completion). Please reduce the length of the "
        f"messages or completion.",
        "max_tokens",
    )


def _at_most(field: str, value: int, limit: int, limit_name: str, unit: str = "") -> None:
    if value > limit:
        what = f"has {value} {unit}" if unit else f"is {value}"
        raise LimitError(
            f"SamplingParams.{field} {what}, more than the limit {limit_name}={limit}", field
        )
