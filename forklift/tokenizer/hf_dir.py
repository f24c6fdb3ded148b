"""The Hugging Face tokenizer directory format: `tokenizer.json` plus its config files."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import tokenizers

from forklift.tokenizer.special_tokens import SpecialTokens


def read_hf_dir(path: Path) -> tuple[tokenizers.Tokenizer, SpecialTokens]:
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
    return backend, special


def write_hf_dir(
    directory: Path,
    backend: tokenizers.Tokenizer,
    special: SpecialTokens,
    generation_eos_ids: Sequence[int],
) -> None:
    """Writes a directory that `read_hf_dir` (and transformers) reads back;
    `generation_eos_ids` go to generation_config.json unless empty."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    backend.save(str(directory / "tokenizer.json"))
    _write_json(directory / "tokenizer_config.json", tokenizer_config(special))
    if generation_eos_ids:
        _write_json(
            directory / "generation_config.json", {"eos_token_id": list(generation_eos_ids)}
        )


def tokenizer_config(special: SpecialTokens) -> dict[str, Any]:
    """The `tokenizer_config.json` fields for `special`, the chat template among them."""
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
    return config


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
