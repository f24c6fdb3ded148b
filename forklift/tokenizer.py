"""Text <-> token id conversion and chat prompt rendering.

`Tokenizer` wraps the Rust `tokenizers` library. It is built either from a Hugging Face style
directory (`tokenizer.json` plus optional config files) or from the vocabulary embedded in a
GGUF file, and can export the latter as a Hugging Face style directory.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import gguf
import jinja2
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, pre_tokenizers, processors
from tokenizers.models import BPE

if TYPE_CHECKING:
    from forklift.model.model_source import ModelSource

logger = logging.getLogger(__name__)

# GGUF token types (llama.cpp's llama_token_type).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# Pre-tokenizer regexes, written exactly as llama.cpp applies them for each
# `tokenizer.ggml.pre` value. llama.cpp runs the expressions one after another, each splitting
# the pieces left by the previous one while keeping unmatched text as pieces of its own; a
# sequence of "isolated" splits reproduces that.
_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_REGEX = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEFAULT_REGEXES = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_REGEX, r"\p{N}+", r"[0-9][0-9][0-9]")
_FALCON_REGEXES = (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2_REGEX, r"[0-9][0-9][0-9]")
_DIGITS_THEN_GPT2 = (r"\p{N}", _GPT2_REGEX)

_PRE_TOKENIZER_REGEXES: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "default": _DEFAULT_REGEXES,
        "falcon": _FALCON_REGEXES,
        **dict.fromkeys(
            ("llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe", "chatglm-bpe"),
            (_LLAMA3_REGEX,),
        ),
        **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2", "hunyuan"), (_QWEN2_REGEX,)),
        **dict.fromkeys(
            ("gpt2", "gpt-2", "phi-2", "mpt", "olmo", "jais", "jina-es", "jina-de"),
            (_GPT2_REGEX,),
        ),
        **dict.fromkeys(
            ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
            _DIGITS_THEN_GPT2,
        ),
    }
)
# Pre types whose Hugging Face tokenizers look a word up whole before applying merges.
_IGNORE_MERGES_PRE_TYPES = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3"})


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


class Tokenizer:
    """Encodes prompts, decodes generated ids and renders chat conversations."""

    def __init__(self, backend: tokenizers.Tokenizer, special: SpecialTokens) -> None:
        self._backend = backend
        self._special = special

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_hf_dir(cls, path: Path) -> Tokenizer:
        """Loads `tokenizer.json` and the optional config files next to it."""
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ValueError(f"{tokenizer_file} not found; a tokenizer.json file is required")
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        config = _read_json(path / "tokenizer_config.json")
        template_file = path / "chat_template.jinja"
        chat_template = (
            template_file.read_text(encoding="utf-8")
            if template_file.is_file()
            else _pick_chat_template(config.get("chat_template"))
        )
        bos_token = _token_content(config.get("bos_token"))
        add_bos = config.get("add_bos_token")
        if add_bos is None:
            add_bos = _post_processor_adds_bos(backend, bos_token)
        special = SpecialTokens(
            bos_token=bos_token,
            eos_token=_token_content(config.get("eos_token")),
            unk_token=_token_content(config.get("unk_token")),
            pad_token=_token_content(config.get("pad_token")),
            add_bos_token=bool(add_bos),
            chat_template=chat_template,
            extra_eos_token_ids=_generation_eos_ids(path / "generation_config.json"),
        )
        return cls(backend, special)

    @classmethod
    def from_gguf(cls, reader: gguf.GGUFReader) -> Tokenizer:
        """Builds the tokenizer from the vocabulary embedded in a GGUF file."""
        model_type = _gguf_value(reader, "tokenizer.ggml.model")
        if model_type != "gpt2":
            raise ValueError(
                f"GGUF tokenizer type {model_type!r} is not supported yet "
                "(only byte-level BPE, tokenizer.ggml.model = 'gpt2')"
            )
        tokens: list[str] = list(_gguf_value(reader, "tokenizer.ggml.tokens", []))
        token_types: list[int] = list(_gguf_value(reader, "tokenizer.ggml.token_type", []))
        merges: list[str] = list(_gguf_value(reader, "tokenizer.ggml.merges", []))
        pre_type = str(_gguf_value(reader, "tokenizer.ggml.pre", "default"))
        backend = _build_byte_level_bpe(tokens, merges, pre_type)
        _register_added_tokens(backend, tokens, token_types)
        special = _gguf_special_tokens(reader, tokens)
        if special.add_bos_token and special.bos_token is not None:
            # Only matters to other consumers of an exported tokenizer.json; encode() adds
            # the BOS itself.
            backend.post_processor = _bos_post_processor(special.bos_token, backend)
        return cls(backend, special)

    def save(self, directory: Path) -> None:
        """Writes a Hugging Face style tokenizer directory that `from_hf_dir` reads back."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self._backend.save(str(directory / "tokenizer.json"))
        special = self._special
        config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": special.bos_token,
            "eos_token": special.eos_token,
            "unk_token": special.unk_token,
            "pad_token": special.pad_token,
            "add_bos_token": special.add_bos_token,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
        }
        if special.chat_template is not None:
            config["chat_template"] = special.chat_template
        _write_json(directory / "tokenizer_config.json", config)
        extra_eos = [i for i in self.eos_token_ids if i != self.eos_token_id]
        if extra_eos:
            eos_ids = [i for i in (self.eos_token_id,) if i is not None] + sorted(extra_eos)
            _write_json(directory / "generation_config.json", {"eos_token_id": eos_ids})

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
        if self._special.chat_template is None:
            raise ValueError(
                "this tokenizer has no chat template; send a plain completion prompt instead"
            )
        variables: dict[str, Any] = {
            "messages": _validate_messages(conversation),
            "tools": tools,
            "add_generation_prompt": add_generation_prompt,
            "bos_token": self._special.bos_token or "",
            "eos_token": self._special.eos_token or "",
            "unk_token": self._special.unk_token or "",
            "pad_token": self._special.pad_token or "",
        }
        variables.update(kwargs)
        try:
            return self._compiled_template.render(**variables)
        except jinja2.TemplateError as exc:
            raise ValueError(f"chat template failed: {exc}") from exc

    @cached_property
    def _compiled_template(self) -> jinja2.Template:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        # Jinja's own tojson escapes HTML characters; chat templates expect plain JSON.
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_template_error
        env.globals["strftime_now"] = _strftime_now
        return env.from_string(self._special.chat_template or "")


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


# ---------------------------------------------------------------------- GGUF helpers


def _gguf_value(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    """Python value of a GGUF metadata field (strings decoded, arrays as lists)."""
    field_ = reader.fields.get(key)
    if field_ is None:
        return default
    if hasattr(field_, "contents"):
        return field_.contents()
    return _legacy_field_value(field_)


def _gguf_special_tokens(reader: gguf.GGUFReader, tokens: list[str]) -> SpecialTokens:
    def token_at(key: str) -> str | None:
        token_id = _gguf_value(reader, key)
        if token_id is None or not 0 <= int(token_id) < len(tokens):
            return None
        return tokens[int(token_id)]

    # llama.cpp also ends generation on the end-of-turn / end-of-message tokens.
    extra_eos = tuple(
        int(token_id)
        for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
        if (token_id := _gguf_value(reader, key)) is not None
    )
    return SpecialTokens(
        bos_token=token_at("tokenizer.ggml.bos_token_id"),
        eos_token=token_at("tokenizer.ggml.eos_token_id"),
        unk_token=token_at("tokenizer.ggml.unknown_token_id"),
        pad_token=token_at("tokenizer.ggml.padding_token_id"),
        add_bos_token=bool(_gguf_value(reader, "tokenizer.ggml.add_bos_token", False)),
        chat_template=_gguf_value(reader, "tokenizer.chat_template"),
        extra_eos_token_ids=extra_eos,
    )


def _legacy_field_value(field_: Any) -> Any:
    """Field decoding for gguf releases that predate `ReaderField.contents()`."""
    string_type = gguf.GGUFValueType.STRING
    if field_.types[0] == gguf.GGUFValueType.ARRAY:
        parts = [field_.parts[i] for i in field_.data]
        if field_.types[-1] == string_type:
            return [bytes(p).decode("utf-8") for p in parts]
        return [p.tolist()[0] for p in parts]
    part = field_.parts[field_.data[0]]
    if field_.types[0] == string_type:
        return bytes(part).decode("utf-8")
    return part.tolist()[0]


def _build_byte_level_bpe(
    tokens: list[str], merges: list[str], pre_type: str
) -> tokenizers.Tokenizer:
    vocab = {token: token_id for token_id, token in enumerate(tokens)}
    model = BPE(
        vocab=vocab,
        merges=[_split_merge(m) for m in merges],
        fuse_unk=False,
        byte_fallback=False,
        ignore_merges=pre_type in _IGNORE_MERGES_PRE_TYPES,
    )
    backend = tokenizers.Tokenizer(model)
    backend.pre_tokenizer = _pre_tokenizer_for(pre_type)
    backend.decoder = decoders.ByteLevel()
    return backend


def _split_merge(merge: str) -> tuple[str, str]:
    # Search from index 1 like llama.cpp, so a merge whose left side is a space still splits.
    pos = merge.find(" ", 1)
    if pos < 0:
        raise ValueError(f"malformed BPE merge {merge!r} in GGUF tokenizer")
    return merge[:pos], merge[pos + 1 :]


def _pre_tokenizer_for(pre_type: str) -> pre_tokenizers.PreTokenizer:
    regexes = _PRE_TOKENIZER_REGEXES.get(pre_type)
    if regexes is None:
        logger.warning("unknown GGUF pre-tokenizer %r; using the GPT-2 regex", pre_type)
        regexes = (_GPT2_REGEX,)
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    return pre_tokenizers.Sequence([*splits, byte_level])


def _register_added_tokens(
    backend: tokenizers.Tokenizer, tokens: list[str], token_types: list[int]
) -> None:
    """Control tokens become special (never split, skippable); user-defined ones plain added."""
    control, user = [], []
    for token, token_type in zip(tokens, token_types, strict=False):
        if token_type == _TOKEN_TYPE_CONTROL:
            control.append(AddedToken(token, special=True, normalized=False))
        elif token_type == _TOKEN_TYPE_USER_DEFINED:
            user.append(AddedToken(token, special=False, normalized=False))
    backend.add_special_tokens(control)
    backend.add_tokens(user)


def _bos_post_processor(bos_token: str, backend: tokenizers.Tokenizer) -> processors.PostProcessor:
    bos_id = backend.token_to_id(bos_token)
    return processors.TemplateProcessing(
        single=f"{bos_token}:0 $A:0",
        pair=f"{bos_token}:0 $A:0 {bos_token}:1 $B:1",
        special_tokens=[(bos_token, bos_id)],
    )


# ---------------------------------------------------------------------- HF dir helpers


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    return json.loads(path.read_text(encoding="utf-8"))


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _token_content(value: Any) -> str | None:
    """Config token entries are either the string or an AddedToken dict with `content`."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _pick_chat_template(value: Any) -> str | None:
    """`chat_template` is a string or a list of named templates; use the default one."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if "default" in named:
            return named["default"]
        return next(iter(named.values()), None)
    return None


def _generation_eos_ids(path: Path) -> tuple[int, ...]:
    eos = _read_json(path).get("eos_token_id")
    if isinstance(eos, int):
        return (eos,)
    if isinstance(eos, list):
        return tuple(int(i) for i in eos)
    return ()


def _post_processor_adds_bos(backend: tokenizers.Tokenizer, bos_token: str | None) -> bool:
    if bos_token is None or backend.token_to_id(bos_token) is None:
        return False
    ids = backend.encode("", add_special_tokens=True).ids
    return bool(ids) and ids[0] == backend.token_to_id(bos_token)


# ---------------------------------------------------------------------- chat helpers


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
