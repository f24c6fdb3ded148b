"""Per-row sampling settings of one step, gathered into tensors once."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch

from forklift.core.scheduler_output import SamplingRow
from forklift.structured.grammar import bitmask_width, fill_bitmasks

T = TypeVar("T")


@dataclass
class SamplingBatch:
    temperature: torch.Tensor  # [N] float32; 0 = greedy
    top_p: torch.Tensor  # [N] float32
    top_k: torch.Tensor  # [N] int64; 0 = off
    min_p: torch.Tensor  # [N] float32
    repetition_penalty: torch.Tensor  # [N] float32
    presence_penalty: torch.Tensor  # [N] float32
    frequency_penalty: torch.Tensor  # [N] float32
    seeds: torch.Tensor  # [N] int64
    steps: torch.Tensor  # [N] int64: index of the token being sampled in the output
    # Token ids (one list per row) that must not be sampled yet (min_tokens).
    banned_token_ids: list[list[int]]
    prompt_token_ids: list[Sequence[int]]
    output_token_ids: list[Sequence[int]]
    num_logprobs: list[int | None]
    raw_logprobs: torch.Tensor  # [N] bool: logprobs of the raw distribution, not the processed
    # Structured outputs: the rows under a grammar, and their allowed tokens as bits
    # [len(rows), ceil(vocab / 32)] int32 (bit t of a row = token t may be sampled).
    grammar_rows: torch.Tensor | None = None
    token_bitmask: torch.Tensor | None = None
    # Per row: logit_bias (token id -> bias) and allowed_token_ids, None where not asked.
    logit_bias: list[dict[int, float] | None] | None = None
    allowed_token_ids: list[list[int] | None] | None = None

    # What the batch needs at all, worked out once by from_rows from the rows' values
    # (float32, as the tensors hold them): the sampler skips every stage no row asks for.
    # The defaults run every stage, so a batch built another way samples correctly.
    all_greedy: bool = False
    needs_top_k_top_p: bool = True
    needs_min_p: bool = True
    needs_penalties: bool = True

    @property
    def max_num_logprobs(self) -> int | None:
        asked = [n for n in self.num_logprobs if n is not None]
        return max(asked) if asked else None

    @classmethod
    def from_rows(
        cls, rows: list[SamplingRow], device: torch.device, vocab_size: int = 0
    ) -> SamplingBatch:
        """`vocab_size` (the logits' width) sizes the token bitmask of grammar rows."""
        params = [r.params for r in rows]
        grammar_rows, token_bitmask = _grammar_bitmask(rows, vocab_size, device)

        # One array per type, each setting a contiguous row: two tensors built, not nine.
        # A value past float32's range becomes inf, as a float32 tensor of it would.
        with np.errstate(over="ignore"):
            floats = np.array(
                [[p.temperature for p in params], [p.top_p for p in params],
                 [p.min_p for p in params], [p.repetition_penalty for p in params],
                 [p.presence_penalty for p in params], [p.frequency_penalty for p in params]],
                dtype=np.float32,
            ).reshape(6, len(rows))  # fmt: skip
        longs = np.array(
            [[max(p.top_k, 0) for p in params], [r.seed for r in rows],
             [r.num_output_tokens for r in rows]],
            dtype=np.int64,
        ).reshape(3, len(rows))  # fmt: skip
        float_rows = torch.from_numpy(floats).to(device)
        long_rows = torch.from_numpy(longs).to(device)
        temperature, top_p, min_p, repetition, presence, frequency = floats
        return cls(
            temperature=float_rows[0],
            top_p=float_rows[1],
            top_k=long_rows[0],
            min_p=float_rows[2],
            repetition_penalty=float_rows[3],
            presence_penalty=float_rows[4],
            frequency_penalty=float_rows[5],
            seeds=long_rows[1],
            steps=long_rows[2],
            banned_token_ids=[banned_tokens(r) for r in rows],
            prompt_token_ids=[r.prompt_token_ids for r in rows],
            output_token_ids=[r.output_token_ids for r in rows],
            num_logprobs=[p.logprobs for p in params],
            raw_logprobs=torch.tensor(
                [p.logprobs_mode == "raw" for p in params], dtype=torch.bool, device=device
            ),
            all_greedy=not bool(temperature.any()),
            needs_top_k_top_p=bool(longs[0].any() or (top_p < 1).any()),
            needs_min_p=bool((min_p > 0).any()),
            needs_penalties=bool((repetition != 1).any() or presence.any() or frequency.any()),
            grammar_rows=grammar_rows,
            token_bitmask=token_bitmask,
            logit_bias=_per_row([p.logit_bias for p in params]),
            allowed_token_ids=_per_row([p.allowed_token_ids for p in params]),
        )


def _per_row(values: list[T | None]) -> list[T | None] | None:
    """The rows' settings, or None where no row has one (the sampler then skips the step)."""
    return values if any(v is not None for v in values) else None


def _grammar_bitmask(
    rows: list[SamplingRow], vocab_size: int, device: torch.device
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    constrained = [i for i, r in enumerate(rows) if r.grammar is not None]
    if not constrained:
        return None, None
    bitmask = np.zeros((len(constrained), bitmask_width(vocab_size)), dtype=np.int32)
    fill_bitmasks([g for r in rows if (g := r.grammar) is not None], bitmask)
    return (
        torch.tensor(constrained, dtype=torch.int64, device=device),
        torch.from_numpy(bitmask).to(device),
    )


def banned_tokens(row: SamplingRow) -> list[int]:
    """min_tokens holding back the stops, and the bad words the output is about to finish."""
    params = row.params
    banned: set[int] = set()
    if row.num_output_tokens < params.min_tokens:
        banned |= set(params.stop_token_ids)
        if not params.ignore_eos:
            banned |= row.eos_token_ids
    output = row.output_token_ids
    for word in params.bad_words_token_ids or ():
        head = len(word) - 1
        if head == 0 or (len(output) >= head and list(output[len(output) - head :]) == word[:-1]):
            banned.add(word[-1])
    return sorted(banned)
