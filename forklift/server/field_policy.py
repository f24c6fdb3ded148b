"""What the server does with request fields it does not act on.

OpenAI's and vLLM's request bodies carry fields forklift has no machinery for (beam search,
prompt embeddings, audio, per-request logits processors). Such a field with a value that
would change the answer is refused with a 400 naming it, never accepted and ignored; its
default (or no-op) value is accepted. Fields that cannot change the output (`user`,
`metadata`) are accepted. Any other unknown field is ignored, as vLLM does, with a warning
in the log naming it (once per field name). docs/serving.md tables every field.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from forklift.server.errors import APIError

logger = logging.getLogger("forklift")


def _absent(value: Any) -> bool:
    return value is None


def _false(value: Any) -> bool:
    return value is None or value is False


def _true(value: Any) -> bool:
    return value is None or value is True


def _equals(default: Any) -> Callable[[Any], bool]:
    return lambda value: value is None or value == default


@dataclass(frozen=True)
class Unsupported:
    """A field forklift refuses unless `accepts` its value (its default, a no-op)."""

    reason: str
    accepts: Callable[[Any], bool] = _absent


UNSUPPORTED: dict[str, Unsupported] = {
    "use_beam_search": Unsupported("beam search is not implemented", _false),
    "length_penalty": Unsupported("it only applies to beam search", _equals(1.0)),
    "truncate_prompt_tokens": Unsupported("prompts are never truncated; send a shorter one"),
    "spaces_between_special_tokens": Unsupported(
        "special tokens are always detokenized with spaces between them", _true
    ),
    "continue_final_message": Unsupported("only a new assistant turn is generated", _false),
    "documents": Unsupported("chat templates get no documents"),
    "chat_template": Unsupported("the model's own chat template is used"),
    "mm_processor_kwargs": Unsupported("no multimodal models are served"),
    "prompt_embeds": Unsupported("prompts are text or token ids"),
    "priority": Unsupported("requests are served first come, first served", _equals(0)),
    "logits_processors": Unsupported(
        "use logit_bias, allowed_token_ids, bad_words or structured outputs instead"
    ),
    "return_tokens_as_token_ids": Unsupported("tokens are returned as text", _false),
    "kv_transfer_params": Unsupported("there is no disaggregated prefill"),
    "vllm_xargs": Unsupported("there are no extension arguments"),
    "structural_tag": Unsupported("use structured_outputs or tools instead"),
    "guided_decoding_backend": Unsupported("llguidance is the only grammar backend"),
    "guided_whitespace_pattern": Unsupported("JSON whitespace follows llguidance's rules"),
    "reasoning_effort": Unsupported("the served models do not reason separately"),
    "include_reasoning": Unsupported("the served models do not reason separately", _true),
    "functions": Unsupported("use tools (the deprecated functions field is not read)"),
    "function_call": Unsupported("use tool_choice (the deprecated field is not read)"),
    "modalities": Unsupported("text is the only modality", _equals(["text"])),
    "audio": Unsupported("text is the only modality"),
    "prediction": Unsupported("predicted outputs are not implemented"),
    "web_search_options": Unsupported("there is no web search"),
    "best_of": Unsupported("only best_of equal to n (no ranking) is served"),
    "echo": Unsupported("chat replies do not echo the conversation", _false),
}

# Distinct unknown field names logged per server, at most.
MAX_LOGGED_NAMES = 64

# Accepted and with no effect on the output, as with OpenAI's own API.
NO_EFFECT = frozenset({"user", "metadata", "store", "service_tier", "request_id"})


@dataclass
class FieldPolicy:
    """Applies UNSUPPORTED to a request's extra fields; remembers the unknown names it has
    already logged (one policy per server)."""

    logged: set[str] = field(default_factory=set)
    # Extra fields another part of the server reads (vLLM's guided_* options).
    understood: frozenset[str] = frozenset()

    def check(self, extra: dict[str, Any], n: int = 1, chat: bool = False) -> None:
        """`chat`: the body is a chat request (vLLM's defaults differ per endpoint)."""
        for name, value in extra.items():
            rule = UNSUPPORTED.get(name)
            if name == "add_special_tokens":
                # What forklift does: a completions prompt gets the tokenizer's special tokens
                # (vLLM's default True there); a chat prompt only what its template writes
                # (vLLM's default False there).
                rule = Unsupported(
                    "special tokens are added as vLLM's default for this endpoint does",
                    _equals(not chat),
                )
            if rule is not None:
                if name == "best_of" and value in (None, n):
                    continue
                if not rule.accepts(value):
                    raise APIError(400, f"{name} is not supported: {rule.reason}", name)
            elif name not in NO_EFFECT and name not in self.understood:
                self._log_unknown(name)

    def _log_unknown(self, name: str) -> None:
        if name in self.logged or len(self.logged) > MAX_LOGGED_NAMES:
            return
        self.logged.add(name)
        if len(self.logged) > MAX_LOGGED_NAMES:
            # A client inventing names must not grow this set or the log without end.
            logger.warning("more than %d unknown request fields: no more are logged",
                           MAX_LOGGED_NAMES)  # fmt: skip
            return
        logger.warning("request field %r is not known to forklift and was ignored", name)
