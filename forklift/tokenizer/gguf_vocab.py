"""A `tokenizers.Tokenizer` built from the vocabulary a GGUF file embeds.

Byte-level BPE vocabularies (`tokenizer.ggml.model = "gpt2"`) split text as llama.cpp does;
SentencePiece ones (`"llama"`) are built the way transformers builds them from the same file.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import gguf
import tokenizers
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

from forklift.tokenizer.special_tokens import SpecialTokens

logger = logging.getLogger(__name__)

# GGUF token types (llama.cpp's llama_token_type).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# SentencePiece writes a space as this character inside its pieces.
_SPM_SPACE = "\u2581"
# Architectures whose SentencePiece vocabulary transformers builds as `GemmaTokenizer`: the
# file order of the tokens, not their scores, ranks the merges, and the tokens made of runs of
# spaces are stored with real spaces although the model spells them with `_SPM_SPACE`.
_GEMMA_ARCHITECTURES = frozenset({"gemma", "gemma2", "gemma3"})
_GEMMA_END_OF_TURN = "<end_of_turn>"

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
# Qwen3.5's: letters with their combining marks, digits one at a time.
_QWEN35_REGEX = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+"
    r"|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
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
        "qwen35": (_QWEN35_REGEX,),
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


def read_gguf_vocab(reader: gguf.GGUFReader) -> tuple[tokenizers.Tokenizer, SpecialTokens]:
    """The tokenizer backend and special tokens embedded in a GGUF file.

    Reads only the file's tokenizer metadata (and its architecture name), so it works for a
    file whose model forklift cannot run.
    """
    model_type = _gguf_value(reader, "tokenizer.ggml.model")
    tokens: list[str] = list(_gguf_value(reader, "tokenizer.ggml.tokens", []))
    token_types: list[int] = list(_gguf_value(reader, "tokenizer.ggml.token_type", []))
    if model_type == "gpt2":
        merges: list[str] = list(_gguf_value(reader, "tokenizer.ggml.merges", []))
        pre_type = str(_gguf_value(reader, "tokenizer.ggml.pre", "default"))
        backend = _build_byte_level_bpe(tokens, merges, pre_type)
        # llama.cpp adds no BOS to a byte-level vocabulary that does not ask for one.
        add_bos_default = False
    elif model_type == "llama":
        backend = _build_sentencepiece_bpe(reader, tokens)
        # ... but does to a SentencePiece one (transformers follows it).
        add_bos_default = True
    else:
        raise ValueError(
            f"GGUF tokenizer type {model_type!r} is not supported yet (only byte-level BPE, "
            "tokenizer.ggml.model = 'gpt2', and SentencePiece, 'llama')"
        )
    special = _gguf_special_tokens(reader, tokens, add_bos_default)
    # SentencePiece builders make the named tokens special even where the file types them
    # normal (transformers' Gemma one does); byte-level files keep their types as they are.
    _register_added_tokens(backend, tokens, token_types, special, model_type == "llama")
    if special.add_bos_token and special.bos_token is not None:
        # Only matters to other consumers of an exported tokenizer.json; Tokenizer.encode()
        # adds the BOS itself.
        backend.post_processor = _bos_post_processor(special.bos_token, backend)
    return backend, special


def _gguf_value(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    """Python value of a GGUF metadata field (strings decoded, arrays as lists)."""
    field_ = reader.fields.get(key)
    if field_ is None:
        return default
    if hasattr(field_, "contents"):
        return field_.contents()
    return _legacy_field_value(field_)


def _gguf_special_tokens(
    reader: gguf.GGUFReader, tokens: list[str], add_bos_default: bool
) -> SpecialTokens:
    def token_at(key: str) -> str | None:
        token_id = _gguf_value(reader, key)
        if token_id is None or not 0 <= int(token_id) < len(tokens):
            return None
        return tokens[int(token_id)]

    # llama.cpp also ends generation on the end-of-turn / end-of-message tokens; Gemma files
    # often name no end-of-turn id, and llama.cpp (like HF's Gemma generation configs) then
    # takes `<end_of_turn>` by name.
    extra_eos = [
        int(token_id)
        for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
        if (token_id := _gguf_value(reader, key)) is not None
    ]
    if not extra_eos and _gguf_value(reader, "general.architecture") in _GEMMA_ARCHITECTURES:
        extra_eos += [i for i, token in enumerate(tokens) if token == _GEMMA_END_OF_TURN][:1]
    return SpecialTokens(
        bos_token=token_at("tokenizer.ggml.bos_token_id"),
        eos_token=token_at("tokenizer.ggml.eos_token_id"),
        unk_token=token_at("tokenizer.ggml.unknown_token_id"),
        pad_token=token_at("tokenizer.ggml.padding_token_id"),
        add_bos_token=bool(_gguf_value(reader, "tokenizer.ggml.add_bos_token", add_bos_default)),
        chat_template=_gguf_value(reader, "tokenizer.chat_template"),
        extra_eos_token_ids=tuple(extra_eos),
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


def _build_sentencepiece_bpe(reader: gguf.GGUFReader, tokens: list[str]) -> tokenizers.Tokenizer:
    """SentencePiece BPE with byte fallback, shaped as transformers' Gemma and Llama tokenizers."""
    gemma = _gguf_value(reader, "general.architecture") in _GEMMA_ARCHITECTURES
    if gemma:
        tokens = [_SPM_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {token: token_id for token_id, token in enumerate(tokens)}
    file_merges = _gguf_value(reader, "tokenizer.ggml.merges")
    if file_merges:
        merges = [_split_merge(m) for m in file_merges]
    else:
        scores = _gguf_value(reader, "tokenizer.ggml.scores")
        if gemma or scores is None:
            ranking = {token: -token_id for token_id, token in enumerate(tokens)}
        else:
            ranking = dict(zip(tokens, scores, strict=False))
        merges = _merges_by_rank(vocab, ranking)
    unk_id = _gguf_value(reader, "tokenizer.ggml.unknown_token_id")
    unk = tokens[int(unk_id)] if unk_id is not None and 0 <= int(unk_id) < len(tokens) else None
    backend = tokenizers.Tokenizer(
        BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    )
    steps = [decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if _gguf_value(reader, "tokenizer.ggml.add_space_prefix", True):  # llama.cpp's default
        backend.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement=_SPM_SPACE, prepend_scheme="first", split=False
        )
        steps.append(decoders.Strip(" ", 1, 0))
    else:
        backend.normalizer = normalizers.Replace(" ", _SPM_SPACE)
        # After that normalizer this split finds no space; it is kept only so the exported
        # tokenizer.json is transformers' own.
        backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    backend.decoder = decoders.Sequence(steps)
    return backend


def _merges_by_rank(
    vocab: Mapping[str, int], ranking: Mapping[str, float]
) -> list[tuple[str, str]]:
    """BPE merges for a vocabulary that ranks whole tokens instead of listing merges.

    SentencePiece joins the adjacent pair whose joined token ranks highest, so every cut of a
    token into two vocabulary tokens becomes a merge, ordered as transformers'
    `generate_merges` orders them: higher-ranked token first, then longer left piece, then
    longer right piece, then vocabulary order.
    """
    merges: list[tuple[str, str]] = []
    in_order = True  # tokens with merges come by strictly falling rank: no sort needed
    previous = float("inf")
    for token, rank in ranking.items():
        count = len(merges)
        for cut in range(len(token) - 1, 0, -1):  # longer left piece first
            left = token[:cut]
            if left in vocab and (right := token[cut:]) in vocab:
                merges.append((left, right))
        if len(merges) > count:
            in_order = in_order and rank < previous
            previous = rank
    if not in_order:
        # Stable, so ties keep vocabulary order; a merge's two pieces spell its token.
        merges.sort(key=lambda m: (-ranking[m[0] + m[1]], -len(m[0]), -len(m[1])))
    return merges


def _register_added_tokens(
    backend: tokenizers.Tokenizer,
    tokens: list[str],
    token_types: list[int],
    special: SpecialTokens,
    named_special: bool,
) -> None:
    """Control tokens (and with `named_special` the file's bos / eos / unk / pad) become
    special (never split, skippable); user-defined ones plain added tokens, as transformers
    adds them."""
    model = backend.model
    control, user = [], []
    for token, token_type in zip(tokens, token_types, strict=False):
        if token_type == _TOKEN_TYPE_CONTROL:
            control.append(AddedToken(token, special=True, normalized=False))
        elif token_type == _TOKEN_TYPE_USER_DEFINED and model.token_to_id(token) is not None:
            # (One the model spells differently, a run of spaces in a Gemma vocabulary, is
            # left to the model, as transformers leaves it.)
            user.append(AddedToken(token, special=False, normalized=False))
    added = {token.content for token in (*control, *user)}
    named = (special.bos_token, special.eos_token, special.unk_token, special.pad_token)
    named = named if named_special else ()
    for token in dict.fromkeys(t for t in named if t is not None and t not in added):
        control.append(AddedToken(token, special=True, normalized=False))
    backend.add_special_tokens(control)
    backend.add_tokens(user)


def _bos_post_processor(bos_token: str, backend: tokenizers.Tokenizer) -> processors.PostProcessor:
    bos_id = backend.token_to_id(bos_token)
    return processors.TemplateProcessing(
        single=f"{bos_token}:0 $A:0",
        pair=f"{bos_token}:0 $A:0 {bos_token}:1 $B:1",
        special_tokens=[(bos_token, bos_id)],
    )
