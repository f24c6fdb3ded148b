"""Text <-> token id conversion for a model, and the conversation prompts of its template.

`Tokenizer` wraps the Rust `tokenizers` library. It is built either from a Hugging Face style
directory (`tokenizer.json` plus optional config files) or from the vocabulary embedded in a
GGUF file, and can export the latter as a Hugging Face style directory.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import gguf
import tokenizers

from forklift.checkpoint.source import ModelSource
from forklift.tokenizer.chat_template import ChatTemplate
from forklift.tokenizer.gguf_vocab import read_gguf_vocab
from forklift.tokenizer.hf_dir import read_hf_dir, write_hf_dir
from forklift.tokenizer.special_tokens import SpecialTokens

logger = logging.getLogger(__name__)


class Tokenizer:
    """Encodes prompts, decodes generated ids and renders chat conversations."""

    def __init__(self, backend: tokenizers.Tokenizer, special: SpecialTokens) -> None:
        self._backend = backend
        self._special = special
        template = special.chat_template
        self._chat_template = None if template is None else ChatTemplate(template, special)

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_hf_dir(cls, path: Path) -> Tokenizer:
        """Loads `tokenizer.json` and the optional config files next to it."""
        return cls(*read_hf_dir(path))

    @classmethod
    def from_gguf(cls, reader: gguf.GGUFReader) -> Tokenizer:
        """Builds the tokenizer from the vocabulary embedded in a GGUF file."""
        return cls(*read_gguf_vocab(reader))

    def save(self, directory: Path) -> None:
        """Writes a Hugging Face style tokenizer directory that `from_hf_dir` reads back."""
        extra_eos = [i for i in self.eos_token_ids if i != self.eos_token_id]
        generation_eos = (
            [i for i in (self.eos_token_id,) if i is not None] + sorted(extra_eos)
            if extra_eos
            else []
        )
        write_hf_dir(directory, self._backend, self._special, generation_eos)

    # ------------------------------------------------------------------ ids and text

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in the text map to their ids."""
        ids = self._backend.encode(text, add_special_tokens=False).ids
        bos = self.bos_token_id
        if add_special_tokens and self._special.add_bos_token and bos is not None:
            if not ids or ids[0] != bos:
                ids.insert(0, bos)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str]:
        """Raw vocabulary pieces (byte-level encoded for BPE vocabularies)."""
        return [self._backend.id_to_token(int(i)) or "" for i in ids]

    def token_text(self, token_id: int) -> str:
        """Decoded text of a single token, special tokens included (for logprob display)."""
        return self._backend.decode([int(token_id)], skip_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def to_json(self) -> str:
        """The whole tokenizer as `tokenizer.json` text (what grammar libraries read)."""
        return self._backend.to_str()

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token(self) -> str | None:
        return self._special.bos_token

    @property
    def eos_token(self) -> str | None:
        return self._special.eos_token

    @property
    def bos_token_id(self) -> int | None:
        return self._id_of(self._special.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self._id_of(self._special.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        return self._id_of(self._special.pad_token)

    @property
    def unk_token_id(self) -> int | None:
        return self._id_of(self._special.unk_token)

    @property
    def add_bos_token(self) -> bool:
        return self._special.add_bos_token

    @cached_property
    def eos_token_ids(self) -> frozenset[int]:
        """Every id that ends generation: the primary EOS plus configured extras."""
        primary = {self.eos_token_id} if self.eos_token_id is not None else set()
        return frozenset(primary | set(self._special.extra_eos_token_ids))

    @cached_property
    def all_special_ids(self) -> frozenset[int]:
        added = self._backend.get_added_tokens_decoder()
        ids = {token_id for token_id, token in added.items() if token.special}
        named = (self.bos_token_id, self.eos_token_id, self.unk_token_id, self.pad_token_id)
        return frozenset(ids | {i for i in named if i is not None})

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)

    # ------------------------------------------------------------------ chat

    @property
    def chat_template(self) -> str | None:
        return self._special.chat_template

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """Renders a conversation into prompt text with the model's Jinja chat template."""
        if self._chat_template is None:
            raise ValueError(
                "this tokenizer has no chat template; send a plain completion prompt instead"
            )
        return self._chat_template.render(conversation, add_generation_prompt, tools, kwargs)

    def encode_chat(
        self,
        conversation: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> list[int]:
        """The prompt ids of a conversation: its rendered template, encoded."""
        text = self.apply_chat_template(
            conversation,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            **template_kwargs,
        )
        # The template already placed any BOS token.
        return self.encode(text, add_special_tokens=False)


def load_tokenizer(source: ModelSource) -> Tokenizer | None:
    """The tokenizer that ships with a model, or None when it has none forklift can use.

    A model without a usable tokenizer still serves prompts given as token ids, so an
    unsupported tokenizer is logged rather than raised.
    """
    if source.format == "hf":
        if not (source.path / "tokenizer.json").is_file():
            logger.warning("%s has no tokenizer.json; prompts must be token ids", source.path)
            return None
        return Tokenizer.from_hf_dir(source.path)
    reader = source.gguf_reader()
    if "tokenizer.ggml.model" not in reader.fields:
        logger.warning("%s embeds no tokenizer; prompts must be token ids", source.path)
        return None
    try:
        return Tokenizer.from_gguf(reader)
    except ValueError as exc:
        logger.warning("%s; prompts must be token ids", exc)
        return None
