"""Paged attention over a flat token batch, in plain PyTorch (portable to any device).

K/V of the step's tokens are written into the paged cache through `slot_mapping`; each
sequence then reads its context back as whole blocks of its block table (one contiguous row
of block_size x kv_heads x head_dim values per block, so the read is a few long copies, not
one short copy per token). Sequences are attended in at most two groups, decodes (one query
each) and prefill chunks: within a group queries are laid out as [seqs, max_query_len] and
keys as [seqs, blocks x block_size], padded with the zeroed null block, so one batched call
serves the whole group with no per-sequence Python loop, and a long prefill chunk does not
pad every decode in the step to its length.

Prefill groups run SDPA. Decode groups run a `DecodeKernel` (layers/decode_attention.py):
on a CPU, SDPA's flash kernel spends 5-13x longer on a single query row per head (measured:
330 vs 95 us at one sequence of 580 tokens, 3.0 ms vs 0.23 ms at 8), and the in-place kernel
reads the cache without copying each context out first.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from forklift.model.kv_cache_dtype import is_quantized_cache, quantize_rows
from forklift.model.layers.decode_attention import (
    DecodeKernel,
    gathered_decode_attention,
    read_blocks,
)
from forklift.model.layers.gated_deltanet import LinearAttentionMetadata


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
    # [seqs, kv_blocks]: the cache blocks each sequence reads, in order; padding -> block 0.
    kv_blocks: torch.Tensor
    # [seqs, 1, max_query_len, kv_blocks * block_size]: True where a query may attend; for a
    # decode group (max_query_len 1), a float32 bias: 0 where it may attend, -inf elsewhere.
    mask: torch.Tensor


@dataclass
class AttentionMetadata:
    """Index tensors shared by every layer of one forward pass."""

    # [num_tokens]: cache slot (block_id * block_size + offset) each new token's K/V goes to.
    slot_mapping: torch.Tensor
    groups: list[AttentionGroup]
    # Hybrid models: the state slots and conv windows of their Gated DeltaNet layers.
    linear: LinearAttentionMetadata | None = None
    # Models whose layers fall into several KV groups (model/kv_layout.py): each group's
    # own metadata (its blocks, its window), the first being this one. Empty: one group.
    kv_groups: list[AttentionMetadata] = field(default_factory=list)


def write_kv(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """key/value: [num_tokens, kv_heads, head_dim] into caches of
    [kv_heads, num_blocks, block_size, row] (row: head_dim, or an int8 cache's codes and
    scale, quantized here)."""
    if is_quantized_cache(key_cache):
        # As bytes: index_copy_ has no fp8 kernel.
        key = quantize_rows(key, key_cache.dtype).view(torch.uint8)
        value = quantize_rows(value, value_cache.dtype).view(torch.uint8)
        key_cache, value_cache = key_cache.view(torch.uint8), value_cache.view(torch.uint8)
    else:  # a cache in a dtype of its own (bf16 under an fp32 model)
        key, value = key.to(key_cache.dtype), value.to(value_cache.dtype)
    kv_heads, row = key.shape[1], key.shape[2]
    key_cache.view(kv_heads, -1, row).index_copy_(1, slot_mapping, key.transpose(0, 1))
    value_cache.view(kv_heads, -1, row).index_copy_(1, slot_mapping, value.transpose(0, 1))


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    decode: DecodeKernel = gathered_decode_attention,
) -> torch.Tensor:
    """query: [num_tokens, heads, head_dim] -> [num_tokens, heads * head_dim]."""
    num_tokens, heads, head_dim = query.shape
    if len(meta.groups) == 1 and meta.groups[0].token_index.numel() == num_tokens:
        group = meta.groups[0]
        if group.query_index.shape[1] == 1:
            # Every token is one sequence's single decode query, already in order: no
            # gather into a padded layout and none back out.
            return _attend(query[:, None], key_cache, value_cache, group, scale, decode)
        return _attend_group(query, key_cache, value_cache, group, scale, decode)
    out = query.new_empty(num_tokens, heads * head_dim)
    for group in meta.groups:
        attended = _attend_group(query, key_cache, value_cache, group, scale, decode)
        out.index_copy_(0, group.token_index, attended)
    return out


def _attend_group(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    group: AttentionGroup,
    scale: float,
    decode: DecodeKernel,
) -> torch.Tensor:
    _, heads, head_dim = query.shape
    padded = torch.cat([query.reshape(-1, heads * head_dim), query.new_zeros(1, heads * head_dim)])
    q = _gather_rows(padded, group.query_index).view(*group.query_index.shape, heads, head_dim)
    out = _attend(q, key_cache, value_cache, group, scale, decode)
    return out.index_select(0, group.padded_index)


def _attend(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    group: AttentionGroup,
    scale: float,
    decode: DecodeKernel,
) -> torch.Tensor:
    """q: [S, Q, H, D] -> [S * Q, H * D], keys and values read through the block tables."""
    seqs, queries, heads, head_dim = q.shape
    if queries == 1:
        flat = q.view(seqs, heads, head_dim)
        bias = group.mask.view(seqs, -1)  # [S, L], strides (L, 1) whatever NumPy gave
        return decode(flat, key_cache, value_cache, group.kv_blocks, bias, scale)
    kv_heads = key_cache.shape[0]
    k = read_blocks(key_cache, group.kv_blocks, q.dtype)  # [Hkv, S, L, D]
    v = read_blocks(value_cache, group.kv_blocks, q.dtype)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),  # [S, H, Q, D]
        k.transpose(0, 1),  # [S, Hkv, L, D]
        v.transpose(0, 1),
        attn_mask=group.mask,
        scale=scale,
        enable_gqa=heads != kv_heads,
    )
    return out.transpose(1, 2).reshape(-1, heads * head_dim)


def _gather_rows(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """table[index] for a 2-D table: index_select is several times faster than indexing."""
    return table.index_select(0, index.reshape(-1))
