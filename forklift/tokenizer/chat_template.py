"""Rendering a conversation with a model's Jinja chat template, as transformers does."""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from functools import cached_property
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from forklift.tokenizer.final_message import cut_at_mark, mark_final_message
from forklift.tokenizer.special_tokens import SpecialTokens


class ChatTemplate:
    """A chat template and the special tokens it may name, compiled on first render (so a
    broken template fails a request, not the tokenizer's loading)."""

    def __init__(self, source: str, special: SpecialTokens) -> None:
        self.source = source
        self._special = special

    def render(
        self,
        conversation: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> str:
        """Prompt text for `conversation`; `extra` variables override the standard ones."""
        if continue_final_message and add_generation_prompt:
            raise ValueError(
                "continue_final_message and add_generation_prompt exclude each other: one "
                "continues the last message, the other opens a new one"
            )
        messages = _validate_messages(conversation)
        if continue_final_message:
            messages = mark_final_message(messages)
        special = self._special
        variables: dict[str, Any] = {
            "messages": messages,
            "tools": tools,
            "documents": documents,
            "add_generation_prompt": add_generation_prompt,
            "bos_token": special.bos_token or "",
            "eos_token": special.eos_token or "",
            "unk_token": special.unk_token or "",
            "pad_token": special.pad_token or "",
        }
        variables.update(extra or {})
        try:
            rendered = self._compiled.render(**variables)
        except jinja2.TemplateError as exc:
            raise ValueError(f"chat template failed: {exc}") from exc
        return cut_at_mark(rendered) if continue_final_message else rendered

    @cached_property
    def _compiled(self) -> jinja2.Template:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        # Jinja's own tojson escapes HTML characters; chat templates expect plain JSON.
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_template_error
        env.globals["strftime_now"] = _strftime_now
        return env.from_string(self.source)


def _validate_messages(conversation: Any) -> list[dict[str, Any]]:
    if not isinstance(conversation, list):
        raise ValueError("messages must be a list of message objects")
    return [_validate_message(i, m) for i, m in enumerate(conversation)]


def _validate_message(index: int, message: Any) -> dict[str, Any]:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise ValueError(f"{where} must be an object with 'role' and 'content'")
    if not isinstance(message.get("role"), str):
        raise ValueError(f"{where}.role must be a string")
    content = message.get("content")
    if content is None and message.get("tool_calls"):
        return dict(message)  # assistant turns that only call tools carry no content
    return {**message, "content": _content_text(f"{where}.content", content)}


def _content_text(where: str, content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where} must be a string or a list of text parts")
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text":
            raise ValueError(f"{where}[{i}] must be a part of type 'text'")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"{where}[{i}].text must be a string")
        texts.append(part["text"])
    return "\n".join(texts)


def _tojson(
    value: Any,
    indent: int | None = None,
    ensure_ascii: bool = False,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, indent=indent, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys
    )


def _raise_template_error(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)
