"""Scheduled sequences -> the index tensors Gated DeltaNet layers read (built once per step)."""

from __future__ import annotations

import numpy as np
import torch

from forklift.model.layers.gated_deltanet import ZERO_SLOT, DeltaRuleGroup, LinearAttentionMetadata


def build_linear_metadata(
    starts: np.ndarray,
    query_lens: np.ndarray,
    slots: np.ndarray,
    conv_kernel: int,
    device: torch.device,
) -> LinearAttentionMetadata:
    """Sequence s computes tokens [starts[s], starts[s] + query_lens[s]) with its state in
    slot slots[s]; its tokens are contiguous in the flat batch, in sequence order."""
    count = len(starts)
    history = conv_kernel - 1
    num_tokens = int(query_lens.sum())
    first_token = np.cumsum(query_lens) - query_lens
    read = np.where(starts == 0, ZERO_SLOT, slots)

    # Position c of a sequence's extended inputs (its kept history, then its new tokens) is
    # row s * history + c of the state rows for c < history, else a row of the step's inputs.
    def extended_row(seq: np.ndarray, c: np.ndarray) -> np.ndarray:
        from_state = seq * history + c
        from_step = count * history + first_token[seq] + c - history
        return np.where(c < history, from_state, from_step)

    seq_of_token = np.repeat(np.arange(count), query_lens)
    offset = np.arange(num_tokens) - first_token[seq_of_token]
    taps = np.arange(conv_kernel)[None, :]
    windows = extended_row(seq_of_token[:, None], offset[:, None] + taps)
    kept = query_lens[:, None] + np.arange(history)[None, :]
    keep = extended_row(np.arange(count)[:, None], kept)

    # Decodes run together; each prefill chunk runs alone, so a short chunk is never padded
    # to a long one's length (the chunked form's cost grows with the padded length).
    decodes = np.flatnonzero(query_lens == 1)
    members = ([decodes] if decodes.size else []) + [
        np.array([s]) for s in np.flatnonzero(query_lens > 1)
    ]
    groups = [
        _group(seqs, query_lens, first_token, read, slots, num_tokens, device) for seqs in members
    ]
    return LinearAttentionMetadata(
        read_slots=_tensor(read, device),
        write_slots=_tensor(slots, device),
        conv_windows=_tensor(windows, device),
        conv_keep=_tensor(keep, device),
        groups=groups,
    )


def _group(
    seqs: np.ndarray,
    query_lens: np.ndarray,
    first_token: np.ndarray,
    read: np.ndarray,
    slots: np.ndarray,
    num_tokens: int,
    device: torch.device,
) -> DeltaRuleGroup:
    lens = query_lens[seqs]
    total = int(lens.sum())
    row = np.repeat(np.arange(len(seqs)), lens)
    offset = np.arange(total) - np.repeat(np.cumsum(lens) - lens, lens)
    token_index = first_token[seqs][row] + offset
    max_len = int(lens.max())
    query_index = np.full((len(seqs), max_len), num_tokens, dtype=np.int64)
    query_index[row, offset] = token_index
    return DeltaRuleGroup(
        read_slots=_tensor(read[seqs], device),
        write_slots=_tensor(slots[seqs], device),
        query_index=_tensor(query_index, device),
        padded_index=_tensor(row * max_len + offset, device),
        token_index=_tensor(token_index, device),
    )


def _tensor(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64)).to(device)
