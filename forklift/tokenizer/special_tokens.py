"""The special tokens and prompt conventions a model's vocabulary comes with."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SpecialTokens:
    """Named special tokens and prompt conventions that sit beside the vocabulary."""

    bos_token: str | None = None
    eos_token: str | None = None
    unk_token: str | None = None
    pad_token: str | None = None
    add_bos_token: bool = False
    chat_template: str | None = None
    extra_eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
