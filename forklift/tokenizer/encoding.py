"""What calling a tokenizer returns: token ids and attention masks, truncated, padded and
turned into tensors with the arguments transformers' tokenizers take."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

PaddingTarget = Literal["none", "longest", "max_length"]

_PADDING_NAMES: dict[Any, PaddingTarget] = {
    False: "none",
    "do_not_pad": "none",
    True: "longest",
    "longest": "longest",
    "max_length": "max_length",
}
_TRUNCATION_NAMES: dict[Any, bool] = {
    None: False,
    False: False,
    "do_not_truncate": False,
    True: True,
    "longest_first": True,
    "only_first": True,
}


class BatchEncoding(dict[str, Any]):
    """`input_ids` and `attention_mask`, read as keys (`enc["input_ids"]`) or as attributes
    (`enc.input_ids`), like transformers' BatchEncoding."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


@dataclass(frozen=True)
class EncodingOptions:
    """transformers' `padding`, `truncation`, `max_length` and `return_tensors`, checked."""

    padding: PaddingTarget = "none"
    truncate: bool = False
    max_length: int | None = None
    return_tensors: Literal["pt", "np"] | None = None
    return_attention_mask: bool = True

    @classmethod
    def parse(
        cls,
        padding: bool | str = False,
        truncation: bool | str | None = False,
        max_length: int | None = None,
        return_tensors: str | None = None,
        return_attention_mask: bool | None = None,
    ) -> EncodingOptions:
        target = _lookup(_PADDING_NAMES, padding, "padding")
        truncate = _lookup(_TRUNCATION_NAMES, truncation, "truncation")
        if max_length is not None and (isinstance(max_length, bool) or max_length < 1):
            raise ValueError(f"max_length must be a positive integer, not {max_length!r}")
        if target == "max_length" and max_length is None:
            raise ValueError("padding='max_length' needs max_length")
        if return_tensors not in (None, "pt", "np"):
            raise ValueError(f"return_tensors must be 'pt', 'np' or None, not {return_tensors!r}")
        return cls(target, truncate, max_length, return_tensors, return_attention_mask is not False)


def shape_batch(
    rows: list[list[int]],
    batched: bool,
    options: EncodingOptions,
    pad_token_id: int | None,
    padding_side: str,
) -> BatchEncoding:
    """The encoding of `rows` (one row unless `batched`), cut and padded per `options`."""
    if options.truncate and options.max_length is not None:
        rows = [row[: options.max_length] for row in rows]
    masks = [[1] * len(row) for row in rows]
    width = _padded_width(rows, options)
    if width is not None:
        if padding_side not in ("left", "right"):
            raise ValueError(f"padding_side must be 'left' or 'right', not {padding_side!r}")
        if pad_token_id is None and any(len(row) < width for row in rows):
            raise ValueError("padding needs a pad token, and this tokenizer has none")
        rows = [_pad(row, width, pad_token_id or 0, padding_side) for row in rows]
        masks = [_pad(mask, width, 0, padding_side) for mask in masks]
    encoding = BatchEncoding(input_ids=rows)
    if options.return_attention_mask:
        encoding["attention_mask"] = masks
    if options.return_tensors is not None:
        # Tensors keep the batch axis even for one text, as transformers does.
        return BatchEncoding({k: _tensor(v, options.return_tensors) for k, v in encoding.items()})
    if not batched:
        return BatchEncoding({key: value[0] for key, value in encoding.items()})
    return encoding


def _lookup(names: dict[Any, Any], value: Any, field: str) -> Any:
    try:
        return names[value]
    except (KeyError, TypeError):
        choices = ", ".join(repr(name) for name in names)
        raise ValueError(f"{field} must be one of {choices}, not {value!r}") from None


def _padded_width(rows: list[list[int]], options: EncodingOptions) -> int | None:
    if options.padding == "max_length":
        return options.max_length  # longer rows stay longer, as in transformers
    if options.padding == "longest" and len(rows) > 1:
        return max(map(len, rows))
    return None


def _pad(row: list[int], width: int, value: int, side: str) -> list[int]:
    fill = [value] * (width - len(row))
    return fill + row if side == "left" else row + fill


def _tensor(rows: list[list[int]], kind: str) -> Any:
    if len({len(row) for row in rows}) > 1:
        raise ValueError("return_tensors needs rows of one length: pass padding=True")
    # Imported here: the tokenizer stays importable without torch.
    if kind == "pt":
        import torch

        return torch.tensor(rows, dtype=torch.long)
    import numpy

    return numpy.array(rows, dtype=numpy.int64)
