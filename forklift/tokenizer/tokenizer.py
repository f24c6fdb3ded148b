"""Text <-> token id conversion for a model, and the conversation prompts of its template.

`Tokenizer` wraps the Rust `tokenizers` library. It is built either from a Hugging Face style
directory (`tokenizer.json` plus optional config files) or from the vocabulary embedded in a
GGUF file, and can export the latter as a Hugging Face style directory.
"""

from __future__ import annotations

import inspect
import logging
import operator
from collections.abc import Iterable, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any, cast

import gguf
import tokenizers

from forklift.checkpoint.source import ModelSource
from forklift.tokenizer.chat_template import ChatTemplate
from forklift.tokenizer.encoding import BatchEncoding, EncodingOptions, shape_batch
from forklift.tokenizer.gguf_vocab import read_gguf_vocab
from forklift.tokenizer.hf_dir import read_hf_dir, tokenizer_config, write_hf_dir
from forklift.tokenizer.special_tokens import SpecialTokens

logger = logging.getLogger(__name__)

Conversation = list[dict[str, Any]]


class Tokenizer:
    """Encodes prompts, decodes generated ids and renders chat conversations.

    Where it shares a method or attribute with transformers' tokenizers, it takes the same
    arguments and gives the same results (the tests hold it to that)."""

    def __init__(self, backend: tokenizers.Tokenizer, special: SpecialTokens) -> None:
        self._backend = backend
        self._special = special
        # Where padding goes when calls pad a batch; "left" for batched generation.
        self.padding_side = "right"
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

    def tokenizer_config(self) -> dict[str, Any]:
        """The `tokenizer_config.json` that `save` writes, chat template included."""
        return tokenizer_config(self._special)

    # ------------------------------------------------------------------ ids and text

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in the text map to their ids."""
        if not isinstance(text, str):
            raise ValueError(f"text must be a string, not {type(text).__name__}")
        ids = self._backend.encode(text, add_special_tokens=False).ids
        bos = self.bos_token_id
        if add_special_tokens and self._special.add_bos_token and bos is not None:
            if not ids or ids[0] != bos:
                ids.insert(0, bos)
        return ids

    def __call__(
        self,
        text: str | Sequence[str],
        add_special_tokens: bool = True,
        padding: bool | str = False,
        truncation: bool | str | None = False,
        max_length: int | None = None,
        return_tensors: str | None = None,
        return_attention_mask: bool | None = None,
    ) -> BatchEncoding:
        """`input_ids` and `attention_mask` of one text, or of each text in a list."""
        options = EncodingOptions.parse(
            padding, truncation, max_length, return_tensors, return_attention_mask
        )
        batched = not isinstance(text, str)
        texts = list(text) if batched else [text]
        if batched and not all(isinstance(t, str) for t in texts):
            raise ValueError("text must be a string or a list of strings")
        rows = [self.encode(t, add_special_tokens) for t in texts]
        return shape_batch(rows, batched, options, self.pad_token_id, self.padding_side)

    def decode(self, ids: int | Iterable[int], skip_special_tokens: bool = False) -> str:
        """The text of `ids`; special tokens stay in it unless `skip_special_tokens`."""
        return self._backend.decode(_id_list(ids), skip_special_tokens=skip_special_tokens)

    def batch_decode(
        self, sequences: Iterable[Iterable[int]], skip_special_tokens: bool = False
    ) -> list[str]:
        return [self.decode(ids, skip_special_tokens) for ids in sequences]

    def convert_ids_to_tokens(self, ids: int | Iterable[int]) -> str | list[str]:
        """Raw vocabulary pieces (byte-level encoded for BPE vocabularies); "" for an id
        outside the vocabulary. One id gives one piece, as in transformers."""
        if not isinstance(ids, Iterable):
            return self._backend.id_to_token(operator.index(ids)) or ""
        return [self._backend.id_to_token(i) or "" for i in _id_list(ids)]

    def convert_tokens_to_ids(self, tokens: str | Iterable[str]) -> int | None | list[int | None]:
        """Ids of vocabulary pieces; a piece not in the vocabulary gets the unknown token's."""
        if isinstance(tokens, str):
            return self._piece_id(tokens)
        return [self._piece_id(token) for token in tokens]

    def _piece_id(self, token: str) -> int | None:
        found = self._backend.token_to_id(token)
        return self.unk_token_id if found is None else found

    def token_text(self, token_id: int) -> str:
        """Decoded text of a single token, special tokens included (for logprob display)."""
        return self._backend.decode([int(token_id)], skip_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def get_vocab(self) -> dict[str, int]:
        return self._backend.get_vocab(with_added_tokens=True)

    def to_json(self) -> str:
        """The whole tokenizer as `tokenizer.json` text (what grammar libraries read)."""
        return self._backend.to_str()

    @property
    def vocab_size(self) -> int:
        """The base vocabulary, without tokens added on top of it (transformers' meaning);
        `len(tokenizer)` counts those too."""
        return self._backend.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token(self) -> str | None:
        return self._special.bos_token

    @property
    def eos_token(self) -> str | None:
        return self._special.eos_token

    @property
    def unk_token(self) -> str | None:
        return self._special.unk_token

    @property
    def pad_token(self) -> str | None:
        return self._special.pad_token

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
        conversation: Conversation | Sequence[Conversation],
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
        tokenize: bool = True,
        padding: bool | str = False,
        truncation: bool | str | None = False,
        max_length: int | None = None,
        return_tensors: str | None = None,
        return_dict: bool = False,
        return_assistant_tokens_mask: bool = False,
        tokenizer_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> str | list[str] | list[int] | list[list[int]] | BatchEncoding:
        """Renders a conversation (or a list of them) with the model's Jinja chat template,
        or with `chat_template` when given, as transformers does: token ids by default,
        the text with `tokenize=False`, ids and attention mask with `return_dict=True`.
        Other keyword arguments become template variables."""
        if return_assistant_tokens_mask:
            raise ValueError("return_assistant_tokens_mask is not supported")
        template = self._template(chat_template)
        batched = _is_batch(conversation)
        conversations = list(conversation) if batched else [conversation]
        texts = [
            template.render(
                c,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tools=tools,
                documents=documents,
                extra=kwargs,
            )
            for c in conversations
        ]
        if not tokenize:
            return texts if batched else texts[0]
        encoding = self(
            texts if batched else texts[0],
            **{
                **(tokenizer_kwargs or {}),
                # The template places any BOS token itself.
                "add_special_tokens": False,
                "padding": padding,
                "truncation": truncation,
                "max_length": max_length,
                "return_tensors": return_tensors,
            },
        )
        return encoding if return_dict else encoding["input_ids"]

    def _template(self, source: str | None) -> ChatTemplate:
        if source is not None:
            if not isinstance(source, str):
                raise ValueError("chat_template must be the text of a Jinja template")
            return ChatTemplate(source, self._special)
        if self._chat_template is None:
            raise ValueError(
                "this tokenizer has no chat template; send a plain completion prompt instead"
            )
        return self._chat_template

    def encode_chat(
        self,
        conversation: Conversation,
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **template_variables: Any,
    ) -> list[int]:
        """The prompt ids of one conversation, opening the assistant's turn by default."""
        clashing = sorted(set(template_variables) & CHAT_TEMPLATE_ARGUMENTS)
        if clashing:
            raise ValueError(
                f"template variables may not be named {', '.join(clashing)}: "
                "apply_chat_template takes those names as its own arguments"
            )
        ids = self.apply_chat_template(
            conversation,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            **template_variables,
        )
        return cast(list[int], ids)


# The keywords apply_chat_template keeps for itself; any other keyword is a template variable.
CHAT_TEMPLATE_ARGUMENTS = frozenset(
    name
    for name in inspect.signature(Tokenizer.apply_chat_template).parameters
    if name not in ("self", "conversation", "kwargs")
)


def _is_batch(conversation: Any) -> bool:
    """A list of conversations rather than one conversation (a list of messages)."""
    if not isinstance(conversation, (list, tuple)):
        raise ValueError("conversation must be a list of messages or a list of conversations")
    if not conversation:
        raise ValueError("conversation must hold at least one message")
    return isinstance(conversation[0], (list, tuple))


def _id_list(ids: int | Iterable[int]) -> list[int]:
    """Token ids as plain ints, from an int, a list, or a tensor or array row."""
    if isinstance(ids, Iterable):
        return [int(i) for i in ids]
    return [operator.index(ids)]


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
