"""Scheduled sequences -> the index tensors Gated DeltaNet layers read (built once per step)."""

from __future__ import annotations

import numpy as np
import torch

from forklift.model.layers.gated_deltanet import (
    ZERO_SLOT,
    DecodeGroup,
    LinearAttentionMetadata,
    PrefillChunk,
)


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

    decodes = np.flatnonzero(query_lens == 1)
    prefills = [
        PrefillChunk(
            read_slot=_tensor(read[s : s + 1], device),
            write_slot=_tensor(slots[s : s + 1], device),
            first=int(first_token[s]),
            length=int(query_lens[s]),
        )
        for s in np.flatnonzero(query_lens > 1)
    ]
    return LinearAttentionMetadata(
        read_slots=_tensor(read, device),
        write_slots=_tensor(slots, device),
        conv_windows=_tensor(windows, device),
        conv_keep=_tensor(keep, device),
        decodes=DecodeGroup(
            read_slots=_tensor(read[decodes], device),
            write_slots=_tensor(slots[decodes], device),
            token_index=_tensor(first_token[decodes], device),
        )
        if decodes.size
        else None,
        prefills=prefills,
    )


def _tensor(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64)).to(device)
