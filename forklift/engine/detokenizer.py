"""Incremental conversion of generated token ids into text, with stop-string detection."""

from __future__ import annotations

from collections.abc import Sequence

from forklift.tokenizer import Tokenizer

# Decoders emit U+FFFD for a UTF-8 character whose bytes are not all present yet.
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text at a small cost per token.

    Text is produced with the prefix/read offset technique: each step decodes only the tokens
    from `_prefix_offset` on and emits what goes beyond the decoding of
    `[_prefix_offset, _read_offset)`. Decoding a few earlier tokens along with the new ones
    lets decoders that treat the first token specially (leading-space stripping) behave as in
    a full decode, and text is held back while it ends in an incomplete character.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stop = tuple(s for s in stop if s)
        self._max_stop_len = max((len(s) for s in self._stop), default=0)
        self._include_stop = include_stop_str_in_output
        self._prefix_offset = 0
        self._read_offset = 0
        self.token_ids: list[int] = []
        self.text = ""
        self.stop_reason: str | None = None

    def update(self, new_token_ids: Sequence[int], check_stop: bool = True) -> bool:
        """Appends tokens and extends `text`; True once a stop string has been found.

        `check_stop=False` (while min_tokens is not reached) extends the text without looking
        for stop strings. After a stop string is found the output is complete and later calls
        change nothing.
        """
        if self.stop_reason is not None:
            return True
        self.token_ids.extend(new_token_ids)
        return self._append(self._decode_new(allow_incomplete=False), check_stop)

    def finalize(self) -> None:
        """Emits text still held back, an incomplete trailing character included."""
        if self.stop_reason is None:
            self._append(self._decode_new(allow_incomplete=True))

    def visible_text(self, finished: bool) -> str:
        """Text that is safe to stream now.

        While generation goes on, a suffix of `text` that could be the start of a stop string
        is withheld, so a stop string split across tokens never reaches a client.
        """
        if finished or self.stop_reason is not None or not self._stop:
            return self.text
        return self.text[: len(self.text) - self._partial_stop_len()]

    def _decode_new(self, allow_incomplete: bool) -> str:
        """Text added by tokens past `_read_offset`; advances the offsets when it is emitted."""
        if self._read_offset >= len(self.token_ids):
            return ""
        prefix_text = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self.token_ids[self._prefix_offset :])
        complete = not full_text.endswith(_REPLACEMENT_CHAR)
        if len(full_text) <= len(prefix_text) or not (complete or allow_incomplete):
            # Nothing visible yet (skipped special token, or a character still missing
            # bytes): keep the window so the next token is decoded together with these.
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        return full_text[len(prefix_text) :]

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _append(self, delta: str, check_stop: bool = True) -> bool:
        if not delta:
            return False
        # A new match must end inside `delta`, so it starts at most max_stop_len - 1 earlier.
        search_from = max(0, len(self.text) - self._max_stop_len + 1)
        self.text += delta
        return check_stop and self._check_stop(search_from)

    def _check_stop(self, search_from: int) -> bool:
        best: tuple[int, str] | None = None
        for stop in self._stop:
            pos = self.text.find(stop, search_from)
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, stop)
        if best is None:
            return False
        pos, stop = best
        self.text = self.text[: pos + len(stop) if self._include_stop else pos]
        self.stop_reason = stop
        return True

    def _partial_stop_len(self) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        for length in range(min(len(self.text), self._max_stop_len - 1), 0, -1):
            tail = self.text[-length:]
            if any(stop.startswith(tail) for stop in self._stop):
                return length
        return 0
