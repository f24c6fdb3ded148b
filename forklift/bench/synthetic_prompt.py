"""Synthetic prompt text with an exact token count under a given tokenizer.

The serving benchmark needs prompts of exactly N tokens that a remote server will tokenize
the same way. Words that are one token each with a leading space make that arithmetic
exact: the text is a first word plus N - (its tokens) single-token words, checked by
encoding the result.
"""

from __future__ import annotations

import random

from forklift.tokenizer import Tokenizer

_WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at "
    "which but have an they you were her she there one all we their has been will more if "
    "no when would who so what up out said its about into than them can only other time new "
    "some could these two may first then do any like my now over such our man me even most "
    "made after also did many before must through back years where much your way well down "
    "should because each just those people how too little state good very make world still "
    "own see men work long get here between both life being under never day same another "
    "know while last might us great old year off come since against go came right used take "
    "three small house light water river garden window morning table city music paper green"
).split()


def single_token_words(tokenizer: Tokenizer) -> list[str]:
    words = [w for w in _WORDS if len(tokenizer.encode(" " + w, add_special_tokens=False)) == 1]
    if len(words) < 16:
        raise ValueError("the tokenizer splits too many common words to build exact prompts")
    return words


def synthetic_prompt(tokenizer: Tokenizer, num_tokens: int, seed: int) -> str:
    """Text that encodes to exactly `num_tokens` tokens (without special tokens).

    Different seeds give different word sequences from the first word on, so prompts do
    not share a prefix (a prefix cache must not flatter the benchmark).
    """
    if num_tokens < 2:
        raise ValueError(f"num_tokens must be >= 2, got {num_tokens}")
    words = single_token_words(tokenizer)
    rng = random.Random(seed)
    head = f"{seed}:"
    head_tokens = len(tokenizer.encode(head, add_special_tokens=False))
    if head_tokens >= num_tokens:
        raise ValueError(f"num_tokens={num_tokens} is too small for a numbered prompt")
    text = head + "".join(" " + rng.choice(words) for _ in range(num_tokens - head_tokens))
    count = len(tokenizer.encode(text, add_special_tokens=False))
    if count != num_tokens:
        raise ValueError(f"built a prompt of {count} tokens instead of {num_tokens}")
    return text
