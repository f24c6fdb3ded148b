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
    read_slots: np.ndarray | None = None,
    continues: np.ndarray | None = None,
) -> LinearAttentionMetadata:
    """Row r computes tokens [starts[r], starts[r] + query_lens[r]) of a sequence and writes
    its state to slot slots[r], reading it from read_slots[r] (default: the same slot); rows'
    tokens are contiguous in the flat batch, in row order. `continues[r]` marks a one-token
    row that carries on the sequence of row r - 1 in this step (rows verifying drafts): it
    reads the state row r - 1 writes, and its convolution sees row r - 1's inputs."""
    rows = len(starts)
    history = conv_kernel - 1
    if read_slots is None:
        read_slots = slots
    if continues is None:
        continues = np.zeros(rows, dtype=bool)
    read = np.where(starts == 0, ZERO_SLOT, read_slots)
    num_tokens = int(query_lens.sum())
    first_token = np.cumsum(query_lens) - query_lens

    # Each chain (a row and the rows continuing it) is one sequence to the convolution: its
    # head's kept inputs, then the chain's tokens.
    chain_of_row = np.cumsum(~continues) - 1
    heads = np.flatnonzero(~continues)
    num_chains = len(heads)
    chain_first = first_token[heads]

    # Position c of a chain's extended inputs (its kept history, then its new tokens) is row
    # chain * history + c of the state rows for c < history, else a row of the step's inputs.
    def extended_row(chain: np.ndarray, c: np.ndarray) -> np.ndarray:
        from_state = chain * history + c
        from_step = num_chains * history + chain_first[chain] + c - history
        return np.where(c < history, from_state, from_step)

    row_of_token = np.repeat(np.arange(rows), query_lens)
    chain_of_token = chain_of_row[row_of_token]
    offset = np.arange(num_tokens) - chain_first[chain_of_token]
    taps = np.arange(conv_kernel)[None, :]
    windows = extended_row(chain_of_token[:, None], offset[:, None] + taps)
    # After row r, its chain keeps the last `history` inputs up to r's last token.
    done = first_token + query_lens - chain_first[chain_of_row]
    keep = extended_row(chain_of_row[:, None], done[:, None] + np.arange(history)[None, :])

    # One-token rows step the recurrent form in waves: a continuing row after the row it
    # continues has written the state it reads.
    decodes = np.flatnonzero(query_lens == 1)
    wave = np.arange(rows) - heads[chain_of_row]  # a row's place in its chain
    waves = []
    for w in range(int(wave[decodes].max()) + 1 if decodes.size else 0):
        members = decodes[wave[decodes] == w]
        waves.append(DecodeGroup(
            read_slots=_tensor(read[members], device),
            write_slots=_tensor(slots[members], device),
            token_index=_tensor(first_token[members], device),
        ))  # fmt: skip
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
        read_slots=_tensor(read[heads], device),
        write_slots=_tensor(slots, device),
        conv_windows=_tensor(windows, device),
        conv_keep=_tensor(keep, device),
        decode_waves=waves,
        prefills=prefills,
    )


def _tensor(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64)).to(device)


def native_state_rows(
    starts: np.ndarray,
    query_lens: np.ndarray,
    slots: np.ndarray,
    read_slots: np.ndarray,
    continues: np.ndarray,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The native step's state slots, one of each per token (csrc/gated_deltanet.h): the
    slot a row's first token starts from (the zero slot at position 0, -1 where the row
    carries on the row before it) and the slot its last token stores the state in; -1 for
    the tokens between."""
    num_tokens = int(query_lens.sum())
    first_token = np.cumsum(query_lens) - query_lens
    reads = np.full(num_tokens, -1, dtype=np.int64)
    writes = np.full(num_tokens, -1, dtype=np.int64)
    starting = np.where(starts == 0, ZERO_SLOT, read_slots)
    reads[first_token] = np.where(continues, -1, starting)
    writes[first_token + query_lens - 1] = slots
    return _tensor(reads, device), _tensor(writes, device)
