"""Scheduled sequences -> the index tensors paged attention reads (built once per step)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from forklift.model.layers.attention import AttentionGroup, AttentionMetadata

DECODE_MIN_BLOCKS = 2


def build_attention_metadata(
    starts: np.ndarray,
    query_lens: np.ndarray,
    block_table: np.ndarray,
    block_size: int,
    sliding_window: int | None,
    device: torch.device,
    min_kv_width: int = 0,
) -> tuple[AttentionMetadata, np.ndarray]:
    """Sequence s computes tokens [starts[s], starts[s] + query_lens[s]) and attends to
    positions [0, starts[s] + query_lens[s]), or with a `sliding_window` to the last that
    many positions of each of its tokens (its keys then start at the block holding its first
    token's oldest one); its tokens are contiguous in the flat batch.
    Key tensors are at least `min_kv_width` wide (captured steps need a fixed shape).

    Returns the metadata and each token's position (the rotary embedding needs them too)."""
    if sliding_window is None and bool((query_lens == 1).all()):
        return _decode_metadata(starts, block_table, block_size, device, min_kv_width)
    num_tokens = int(query_lens.sum())
    first_token = np.cumsum(query_lens) - query_lens
    seq_of_token = np.repeat(np.arange(len(starts)), query_lens)
    positions = starts[seq_of_token] + np.arange(num_tokens) - first_token[seq_of_token]
    slot_mapping = block_table[seq_of_token, positions // block_size] * block_size + (
        positions % block_size
    )
    decode = query_lens == 1
    groups = [
        _group(
            np.flatnonzero(members),
            starts,
            query_lens,
            first_token,
            block_table,
            block_size,
            sliding_window,
            num_tokens,
            device,
            min_kv_width,
        )
        for members in (decode, ~decode)
        if members.any()
    ]
    return AttentionMetadata(_tensor(slot_mapping, device), groups), positions


def _decode_metadata(
    starts: np.ndarray,
    block_table: np.ndarray,
    block_size: int,
    device: torch.device,
    min_kv_width: int,
) -> tuple[AttentionMetadata, np.ndarray]:
    """`build_attention_metadata` for a step of decode rows only (one token each, no
    window): the same tensors, in a handful of operations (a decode step's host time is
    worth saving: it is a tenth of a single stream's step)."""
    count = len(starts)
    rows = np.arange(count)
    slot_mapping = block_table[rows, starts // block_size] * block_size + starts % block_size
    num_blocks = max(
        int(starts.max()) // block_size + 1, -(-min_kv_width // block_size), DECODE_MIN_BLOCKS
    )
    kv_blocks = np.zeros((count, num_blocks), dtype=np.int64)
    width = min(num_blocks, block_table.shape[1])
    kv_blocks[:, :width] = block_table[:, :width]
    mask = np.where(
        np.arange(num_blocks * block_size)[None, :] <= starts[:, None],
        np.float32(0),
        np.float32(-np.inf),
    )
    index = _tensor(rows, device)
    group = AttentionGroup(
        query_index=index[:, None],
        padded_index=index,
        token_index=index,
        kv_blocks=_tensor(kv_blocks, device),
        mask=_tensor(mask[:, None, None, :], device),
    )
    return AttentionMetadata(_tensor(slot_mapping, device), [group]), starts.copy()


def _group(
    seqs: np.ndarray,
    starts: np.ndarray,
    query_lens: np.ndarray,
    first_token: np.ndarray,
    block_table: np.ndarray,
    block_size: int,
    sliding_window: int | None,
    num_tokens: int,
    device: torch.device,
    min_kv_width: int,
) -> AttentionGroup:
    starts, query_lens, table = starts[seqs], query_lens[seqs], block_table[seqs]
    count = len(seqs)
    group_tokens = int(query_lens.sum())
    row = np.repeat(np.arange(count), query_lens)
    offset = np.arange(group_tokens) - np.repeat(np.cumsum(query_lens) - query_lens, query_lens)
    token_index = first_token[seqs][row] + offset

    max_q = int(query_lens.max())
    query_index = np.full((count, max_q), num_tokens, dtype=np.int64)
    query_index[row, offset] = token_index
    padded_index = row * max_q + offset

    kv_lens = starts + query_lens
    # With a window, a sequence's keys start at the block holding its first query's oldest
    # visible position: blocks before it are masked out anyway (and may be freed).
    first = np.zeros(count, dtype=np.int64)
    if sliding_window is not None:
        first = np.maximum(starts - sliding_window + 1, 0) // block_size
    # Whole blocks are read: the key width is a multiple of block_size, padding masked.
    ends = -(-kv_lens // block_size)
    num_blocks = max(int((ends - first).max()), -(-min_kv_width // block_size))
    if max_q == 1:
        # At least two blocks (padding masked): a width of one would make the compiled
        # decode kernel specialise, i.e. compile again, on it.
        num_blocks = max(num_blocks, DECODE_MIN_BLOCKS)
    # Padding -> the null block.
    wide = np.zeros((count, int(first.max()) + num_blocks), dtype=np.int64)
    width = min(wide.shape[1], table.shape[1])
    wide[:, :width] = table[:, :width]
    kv_blocks = wide[np.arange(count)[:, None], first[:, None] + np.arange(num_blocks)]
    kv_pos = first[:, None] * block_size + np.arange(num_blocks * block_size)[None, :]
    kv_valid = kv_pos < kv_lens[:, None]

    q_pos = starts[:, None] + np.arange(max_q)[None, :]  # [S, Q]
    mask = (kv_pos[:, None, :] <= q_pos[:, :, None]) & kv_valid[:, None, :]
    if sliding_window is not None:
        mask &= kv_pos[:, None, :] > q_pos[:, :, None] - sliding_window
    if max_q == 1:
        # Decode attention adds the mask to float32 scores (see paged_attention).
        mask = np.where(mask, np.float32(0), np.float32(-np.inf))
    return AttentionGroup(
        query_index=_tensor(query_index, device),
        padded_index=_tensor(padded_index, device),
        token_index=_tensor(token_index, device),
        kv_blocks=_tensor(kv_blocks, device),
        mask=_tensor(mask[:, None, :, :], device),
    )


def _tensor(array: np.ndarray, device: torch.device) -> torch.Tensor:
    array = np.ascontiguousarray(array)
    if array.dtype.kind in "iu":
        array = array.astype(np.int64, copy=False)
    return torch.from_numpy(array).to(device)


@dataclass(frozen=True)
class RowAttention:
    """One KV group's metadata for the native step, one row per token: each row reads its
    sequence's blocks from block 0 (so positions, and the attention kernel's chunks of them,
    are the same whatever else the step holds), masked to the positions its token sees."""

    slot_mapping: torch.Tensor  # [tokens]: where each token's K/V goes
    kv_blocks: torch.Tensor  # [tokens, width]: its sequence's blocks, padding -> block 0
    bias: torch.Tensor  # [tokens, width * block_size] float32: 0 where it attends, else -inf


def build_row_attention(
    starts: np.ndarray,
    query_lens: np.ndarray,
    tables: list[np.ndarray],
    windows: list[int | None],
    block_size: int,
    device: torch.device,
) -> tuple[list[RowAttention], np.ndarray]:
    """Sequence s computes tokens [starts[s], starts[s] + query_lens[s]); token t at position
    p attends to positions [0, p], or with a window to (p - window, p]. One entry per KV
    group (`tables[g]`: [seqs, table width] block ids, `windows[g]`), and each token's
    position."""
    seq_of_token = np.repeat(np.arange(len(starts)), query_lens)
    first_token = np.cumsum(query_lens) - query_lens
    positions = starts[seq_of_token] + np.arange(len(seq_of_token)) - first_token[seq_of_token]
    width = int((starts + query_lens).max() + block_size - 1) // block_size
    columns = np.arange(width * block_size)
    groups = []
    for table, window in zip(tables, windows, strict=True):
        slot_mapping = table[seq_of_token, positions // block_size] * block_size + (
            positions % block_size
        )
        blocks = np.zeros((len(starts), width), dtype=np.int64)
        reach = min(width, table.shape[1])
        blocks[:, :reach] = table[:, :reach]
        visible = columns[None, :] <= positions[:, None]
        if window is not None:
            visible &= columns[None, :] > positions[:, None] - window
        bias = np.where(visible, np.float32(0), np.float32(-np.inf))
        groups.append(
            RowAttention(
                _tensor(slot_mapping, device),
                _tensor(blocks[seq_of_token], device),
                torch.from_numpy(bias).to(device),
            )
        )
    return groups, positions
