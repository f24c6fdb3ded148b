"""Paged attention over a flat token batch, in plain PyTorch (portable to any device).

K/V of the step's tokens are written into the paged cache through `slot_mapping`; each
sequence then reads its whole context back through per-token slot indices derived from its
block table. Queries are laid out as [num_seqs, max_query_len] and keys as
[num_seqs, max_kv_len] with padding that points at the zeroed null block, so one batched
SDPA call serves prefill chunks and decodes alike, with no per-sequence Python loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Index tensors shared by every layer of one forward pass."""

    # [num_tokens]: cache slot (block_id * block_size + offset) each new token's K/V goes to.
    slot_mapping: torch.Tensor
    # [num_seqs, max_query_len]: flat token index of each query; padding points at row
    # num_tokens (an extra zero row).
    query_index: torch.Tensor
    # [num_tokens]: where each token sits in the flattened [num_seqs * max_query_len] layout.
    output_index: torch.Tensor
    # [num_seqs, max_kv_len]: cache slot of each context position; padding -> null slot 0.
    kv_slots: torch.Tensor
    # [num_seqs, 1, max_query_len, max_kv_len]: True where a query may attend.
    mask: torch.Tensor


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
    kv_heads = key_cache.shape[2]
    padded = torch.cat([query, query.new_zeros(1, heads, head_dim)])
    q = padded[meta.query_index].transpose(1, 2)  # [S, H, Q, D]
    k = key_cache.view(-1, kv_heads, head_dim)[meta.kv_slots].transpose(1, 2)  # [S, Hkv, K, D]
    v = value_cache.view(-1, kv_heads, head_dim)[meta.kv_slots].transpose(1, 2)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=meta.mask, scale=scale, enable_gqa=heads != kv_heads
    )
    out = out.transpose(1, 2).reshape(-1, heads * head_dim)  # [S * Q, H * D]
    return out[meta.output_index]
