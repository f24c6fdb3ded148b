"""Paged attention over a flat token batch, in plain PyTorch (portable to any device).

K/V of the step's tokens are written into the paged cache through `slot_mapping`; each
sequence then reads its whole context back through per-token slot indices derived from its
block table. Sequences are attended in at most two groups, decodes (one query each) and
prefill chunks: within a group queries are laid out as [seqs, max_query_len] and keys as
[seqs, max_kv_len], padded with the zeroed null block, so one batched SDPA call serves the
whole group with no per-sequence Python loop, and a long prefill chunk does not pad every
decode in the step to its length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionGroup:
    """Sequences attended together by one SDPA call."""

    # [seqs, max_query_len]: flat token index of each query; padding points at row
    # num_tokens (an extra zero row).
    query_index: torch.Tensor
    # [tokens in group]: where each of the group's tokens sits in [seqs * max_query_len].
    padded_index: torch.Tensor
    # [tokens in group]: the flat index of those tokens in the step's batch.
    token_index: torch.Tensor
    # [seqs, max_kv_len]: cache slot of each context position; padding -> null slot 0.
    kv_slots: torch.Tensor
    # [seqs, 1, max_query_len, max_kv_len]: True where a query may attend.
    mask: torch.Tensor


@dataclass
class AttentionMetadata:
    """Index tensors shared by every layer of one forward pass."""

    # [num_tokens]: cache slot (block_id * block_size + offset) each new token's K/V goes to.
    slot_mapping: torch.Tensor
    groups: list[AttentionGroup]


def write_kv(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """key/value: [num_tokens, kv_heads, head_dim] into caches of
    [num_blocks, block_size, kv_heads, head_dim]."""
    kv_heads, head_dim = key.shape[1], key.shape[2]
    key_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """query: [num_tokens, heads, head_dim] -> [num_tokens, heads * head_dim]."""
    num_tokens, heads, head_dim = query.shape
    if len(meta.groups) == 1 and meta.groups[0].token_index.numel() == num_tokens:
        group = meta.groups[0]
        if group.query_index.shape[1] == 1:
            # Every token is one sequence's single decode query, already in order: no
            # gather into a padded layout and none back out.
            return _attend(query[:, None], key_cache, value_cache, group, scale)
        return _attend_group(query, key_cache, value_cache, group, scale)
    out = query.new_empty(num_tokens, heads * head_dim)
    for group in meta.groups:
        out.index_copy_(
            0, group.token_index, _attend_group(query, key_cache, value_cache, group, scale)
        )
    return out


def _attend_group(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    group: AttentionGroup,
    scale: float,
) -> torch.Tensor:
    _, heads, head_dim = query.shape
    padded = torch.cat([query.reshape(-1, heads * head_dim), query.new_zeros(1, heads * head_dim)])
    q = _gather_rows(padded, group.query_index).view(*group.query_index.shape, heads, head_dim)
    out = _attend(q, key_cache, value_cache, group, scale)
    return out.index_select(0, group.padded_index)


def _attend(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    group: AttentionGroup,
    scale: float,
) -> torch.Tensor:
    """q: [S, Q, H, D] -> [S * Q, H * D], keys and values read through the block tables."""
    heads, head_dim = q.shape[2], q.shape[3]
    kv_heads = key_cache.shape[2]
    k = _gather_rows(key_cache.view(-1, kv_heads * head_dim), group.kv_slots)
    v = _gather_rows(value_cache.view(-1, kv_heads * head_dim), group.kv_slots)
    kv_shape = (*group.kv_slots.shape, kv_heads, head_dim)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),  # [S, H, Q, D]
        k.view(kv_shape).transpose(1, 2),  # [S, Hkv, K, D]
        v.view(kv_shape).transpose(1, 2),
        attn_mask=group.mask,
        scale=scale,
        enable_gqa=heads != kv_heads,
    )
    return out.transpose(1, 2).reshape(-1, heads * head_dim)


def _gather_rows(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """table[index] for a 2-D table: index_select is several times faster than indexing."""
    return table.index_select(0, index.reshape(-1))
