"""Grammars compiled once per constraint, and one matcher per sequence (llguidance).

llguidance was picked over xgrammar by measurement and weight (benchmarks/grammar-backends.md):
on the default model's 49,152-token vocabulary both build a mask in well under a millisecond
(JSON schema: 27 us vs 5 us mean; regex: 85 us vs 214 us), against a decode step of about
20 ms, and llguidance compiles a constraint ten times faster (0.8 ms vs 7 ms). xgrammar's
wheel requires triton and transformers; llguidance depends on nothing.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable

import llguidance
import numpy as np

from forklift.structured.params import StructuredOutputsError, StructuredOutputsParams
from forklift.tokenizer import Tokenizer

# Compiled grammars kept per engine; a busy server sees few distinct schemas.
_CACHE_SIZE = 128


def bitmask_width(vocab_size: int) -> int:
    """int32 words per row of a token bitmask (bit t of the row = token t is allowed)."""
    return (vocab_size + 31) // 32


class GrammarMatcher:
    """Where one sequence stands in its grammar: the allowed next tokens, and advancing."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher

    def fill_bitmask(self, row: np.ndarray) -> None:
        """Write the allowed-token bits into `row` (a C-contiguous int32 array)."""
        self._matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; False if the grammar does not allow it."""
        return self._matcher.consume_token(token_id)

    def valid_prefix(self, token_ids: list[int]) -> int:
        """How many of `token_ids`, in order from here, the grammar allows (nothing moves)."""
        return self._matcher.validate_tokens(token_ids) if token_ids else 0

    def after(self, token_ids: list[int]) -> GrammarMatcher:
        """This matcher as it will stand once `token_ids` (which it allows) are consumed: a
        view whose masks are computed there; it never advances the matcher itself."""
        return _DraftedGrammar(self._matcher, list(token_ids)) if token_ids else self

    @property
    def is_finished(self) -> bool:
        """Nothing may follow but end-of-sequence (or the grammar was broken)."""
        return self._matcher.is_stopped() or self._matcher.is_error()

    @property
    def error(self) -> str:
        return self._matcher.get_error()


class _DraftedGrammar(GrammarMatcher):
    """The allowed tokens after a sequence's drafts (speculative decoding): the mask is
    computed with the drafts consumed, and the matcher rolled back at once."""

    def __init__(self, matcher: llguidance.LLMatcher, token_ids: list[int]) -> None:
        super().__init__(matcher)
        self._token_ids = token_ids

    def fill_bitmask(self, row: np.ndarray) -> None:
        consumed = self._matcher.consume_tokens(self._token_ids)
        try:
            super().fill_bitmask(row)
        finally:
            self._matcher.rollback(len(self._token_ids) if consumed else 0)

    def accept(self, token_id: int) -> bool:
        raise RuntimeError("a drafted view only computes masks")


class GrammarCompiler:
    """Turns `StructuredOutputsParams` into matchers for one tokenizer and vocabulary.

    The llguidance tokenizer is built on first use (about 0.2 s for a 49k vocabulary), so
    engines that never see a constraint never pay for it. Safe to call from several threads:
    the server compiles while validating, off the engine thread.
    """

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._lock = threading.Lock()
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()

    def matchers(self, params: StructuredOutputsParams, count: int) -> list[GrammarMatcher]:
        """`count` independent matchers at the start of the grammar (one per sample)."""
        template = self.compile(params)
        return [GrammarMatcher(template.deep_copy()) for _ in range(count)]

    def compile(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        """The constraint's matcher at its start, compiled once; StructuredOutputsError if it
        is malformed or can match nothing."""
        key = params.cache_key()
        with self._lock:
            cached = self._compiled.get(key)
            if cached is not None:
                self._compiled.move_to_end(key)
                return cached
        template = self._build(params)
        with self._lock:
            self._compiled[key] = template
            while len(self._compiled) > _CACHE_SIZE:
                self._compiled.popitem(last=False)
        return template

    @property
    def num_cached(self) -> int:
        return len(self._compiled)

    def _build(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        grammar = _grammar_text(params)
        matcher = llguidance.LLMatcher(self._get_ll_tokenizer(params.param), grammar, log_level=0)
        if matcher.is_error():
            raise StructuredOutputsError(params.param, f"does not compile: {matcher.get_error()}")
        # A grammar whose language is empty (e.g. the regex [^\s\S]) compiles, then fails on
        # its first mask: refuse it here rather than decode garbage.
        probe = matcher.deep_copy()
        probe.compute_bitmask()
        if probe.is_error():
            reason = probe.get_error().splitlines()[0]  # the rest is a parser state dump
            raise StructuredOutputsError(params.param, f"can match nothing ({reason})")
        return matcher

    def _get_ll_tokenizer(self, param: str) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = self._build_ll_tokenizer(param)
            return self._ll_tokenizer

    def _build_ll_tokenizer(self, param: str) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            raise StructuredOutputsError(param, "this model has no tokenizer to constrain")
        try:
            return llguidance.LLTokenizer(
                self._tokenizer.to_json(),
                n_vocab=self._vocab_size,
                eos_token=sorted(self._tokenizer.eos_token_ids),
            )
        except (ValueError, RuntimeError) as exc:
            raise StructuredOutputsError(
                param, f"this model's tokenizer cannot be constrained: {exc}"
            ) from exc


def _grammar_text(params: StructuredOutputsParams) -> str:
    kind = params.kind
    if kind in ("json", "json_object"):
        try:
            # Compact separators unless asked: small models given free whitespace tend to
            # spend their whole budget on newlines.
            return llguidance.LLMatcher.grammar_from_json_schema(
                params.schema(),
                defaults={"whitespace_flexible": params.any_whitespace},
            )
        except ValueError as exc:
            raise StructuredOutputsError(params.param, f"invalid JSON schema: {exc}") from exc
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(params.regex or "")
    if kind == "choice":
        return llguidance.grammar_from("choice", list(params.choice or ()))
    try:
        return llguidance.grammar_from("grammar", params.grammar or "")
    except ValueError as exc:
        raise StructuredOutputsError(params.param, f"invalid grammar: {exc}") from exc


def fill_bitmasks(matchers: Iterable[GrammarMatcher], bitmask: np.ndarray) -> None:
    """Row i of `bitmask` [N, words] int32 <- the allowed tokens of matcher i."""
    for row, matcher in enumerate(matchers):
        matcher.fill_bitmask(bitmask[row])
