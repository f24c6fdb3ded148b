"""Prompt logprobs: each prompt position's logprob of the next prompt token, computed from
the hidden states a prefill chunk produces anyway.

Rows are scored a slice at a time, so a 2048-token chunk never holds its full [rows, vocab]
logits at once; only each row's logprob, rank and top tokens leave the step. The scores are
those of the model's raw distribution (no penalties, temperature or truncation apply to a
prompt).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from forklift.core.scheduler_output import ScheduledChunk
from forklift.model.layers.quantized import ALWAYS_DENSE_ROWS

# Rows of logits alive at once while scoring (x vocab x 4 bytes: 48 MiB at 49k tokens).
SCORE_SLICE_ROWS = 256


@dataclass
class PromptScores:
    """One entry per scored row: the target's logprob and rank, and the top tokens."""

    logprobs: list[float]
    ranks: list[int]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]

    def rows(self, start: int, end: int) -> PromptScores:
        return PromptScores(
            self.logprobs[start:end],
            self.ranks[start:end],
            self.top_ids[start:end],
            self.top_logprobs[start:end],
        )


def prompt_rows_of(
    scheduled: Sequence[ScheduledChunk], offsets: np.ndarray
) -> tuple[np.ndarray, np.ndarray, int] | None:
    """(flat rows, target ids, most top tokens asked) of the chunks scoring their prompt;
    `offsets` is each chunk's first flat row. None when no chunk asks."""
    rows: list[np.ndarray] = []
    targets: list[Sequence[int]] = []
    top = 0
    for chunk, offset in zip(scheduled, offsets, strict=False):
        if not chunk.scores_prompt:
            continue
        rows.append(offset + np.arange(len(chunk.prompt_logprob_targets), dtype=np.int64))
        targets.append(chunk.prompt_logprob_targets)
        top = max(top, chunk.prompt_logprobs or 0)
    if not rows:
        return None
    flat_targets = np.concatenate([np.asarray(t, dtype=np.int64) for t in targets])
    return np.concatenate(rows), flat_targets, top


def score_prompt_rows(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    targets: torch.Tensor,
    top: int,
) -> PromptScores:
    scores = PromptScores([], [], [], [])
    for start in range(0, hidden.shape[0], SCORE_SLICE_ROWS):
        rows = hidden[start : start + SCORE_SLICE_ROWS]
        count = rows.shape[0]
        if count < ALWAYS_DENSE_ROWS:
            # A few rows would take the quantized head's path: pad them onto the dense one,
            # so a token's score does not depend on how the prompt was chunked or batched.
            rows = torch.cat([rows, rows.new_zeros(ALWAYS_DENSE_ROWS - count, rows.shape[1])])
        logits = compute_logits(rows)[:count]
        logprobs = torch.log_softmax(logits, dim=-1)
        end = start + count
        chosen = logprobs.gather(1, targets[start:end, None])
        scores.logprobs += chosen[:, 0].tolist()
        scores.ranks += ((logprobs > chosen).sum(dim=-1) + 1).tolist()
        if top > 0:
            values, ids = logprobs.topk(top, dim=-1)
            scores.top_ids += ids.tolist()
            scores.top_logprobs += values.tolist()
        else:
            scores.top_ids += [[] for _ in range(chosen.shape[0])]
            scores.top_logprobs += [[] for _ in range(chosen.shape[0])]
    return scores


def split_prompt_scores(
    scheduled: Sequence[ScheduledChunk], scores: PromptScores
) -> list[tuple[int, PromptScores]]:
    """Each scoring chunk's rows, in the order `prompt_rows_of` laid them out."""
    parts = []
    row = 0
    for item, chunk in enumerate(scheduled):
        if not chunk.scores_prompt:
            continue
        count = len(chunk.prompt_logprob_targets)
        parts.append((item, scores.rows(row, row + count)))
        row += count
    return parts
