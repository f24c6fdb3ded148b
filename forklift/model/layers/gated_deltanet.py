"""Gated DeltaNet: the linear-attention layer of Qwen3.5's hybrid stack, over a flat batch.

A layer keeps no KV cache. Each running sequence owns a state slot instead: the last
conv_kernel - 1 inputs of its short causal convolution and a [key_dim, value_dim] recurrent
state per value head. Slot 0 is all zeros and is never written; a sequence that starts at
position 0 reads it, so a fresh, recomputed or reused slot needs no clearing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from forklift.model.layers.gated_delta_rule import (
    chunked_gated_delta_rule,
    recurrent_gated_delta_step,
)
from forklift.model.layers.linear import Linear
from forklift.model.layers.norm import GatedRMSNorm
from forklift.model.model_config import LinearAttentionConfig

# The state slot every sequence at position 0 reads from.
ZERO_SLOT = 0


@dataclass
class DeltaRuleGroup:
    """Sequences whose delta rule runs in one call: the decodes (recurrent form) or one
    prefill chunk (chunked form)."""

    read_slots: torch.Tensor  # [seqs]: the state each starts from (ZERO_SLOT at position 0)
    write_slots: torch.Tensor  # [seqs]: where its new state goes
    # [seqs, max_len]: flat token index of each position; padding points at row num_tokens.
    query_index: torch.Tensor
    padded_index: torch.Tensor  # [tokens in group]: position of each token in seqs x max_len
    token_index: torch.Tensor  # [tokens in group]: the flat index of those tokens


@dataclass
class LinearAttentionMetadata:
    """Index tensors every Gated DeltaNet layer of one step shares."""

    read_slots: torch.Tensor  # [seqs], in the step's order
    write_slots: torch.Tensor  # [seqs]
    # [num_tokens, conv_kernel]: each token's window, indexing cat(states of every sequence
    # flattened to [seqs * (conv_kernel - 1)], the step's inputs).
    conv_windows: torch.Tensor
    # [seqs, conv_kernel - 1]: the inputs each sequence keeps, indexing the same rows.
    conv_keep: torch.Tensor
    groups: list[DeltaRuleGroup]


def causal_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    states: torch.Tensor,
    windows: torch.Tensor,
    keep: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution then silu. x: [T, C]; weight: [C, 1, K];
    states: [S, K - 1, C]. Returns the outputs [T, C] and the new states [S, K - 1, C]."""
    rows = torch.cat([states.reshape(-1, x.shape[1]), x])
    taps = rows.index_select(0, windows.reshape(-1)).view(*windows.shape, x.shape[1])
    # Accumulated in float32, as a convolution kernel does.
    out = (taps.float() * weight.squeeze(1).t().float()).sum(1).to(x.dtype)
    new_states = rows.index_select(0, keep.reshape(-1)).view(*keep.shape, x.shape[1])
    return F.silu(out), new_states


def delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    meta: LinearAttentionMetadata,
) -> torch.Tensor:
    """q, k: [T, H, Dk]; v: [T, H, Dv]; g, beta: [T, H] (float32). Reads and writes each
    sequence's recurrent state in `state_pool` [slots, H, Dk, Dv]; returns [T, H, Dv]."""
    num_tokens = q.shape[0]
    out: torch.Tensor | None = None
    for group in meta.groups:
        state = state_pool.index_select(0, group.read_slots)
        if group.query_index.shape[1] == 1:
            every = group.token_index.numel() == num_tokens and len(meta.groups) == 1
            index = group.token_index
            inputs = [q, k, v, g, beta]
            if not every:
                inputs = [t.index_select(0, index) for t in inputs]
            result, state = recurrent_gated_delta_step(*inputs, state)
        else:
            padded = [_pad_gather(t, group.query_index) for t in (q, k, v, g, beta)]
            chunk_out, state = chunked_gated_delta_rule(*padded, state)
            result = chunk_out.reshape(-1, *chunk_out.shape[2:]).index_select(0, group.padded_index)
            every = False
        state_pool.index_copy_(0, group.write_slots, state)
        if every:
            return result
        if out is None:
            out = v.new_empty(num_tokens, *v.shape[1:])
        out.index_copy_(0, group.token_index, result)
    assert out is not None
    return out


def _pad_gather(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x: [T, ...] -> [S, L, ...] by a [S, L] index, where index T is a zero row."""
    rows = torch.cat([x, x.new_zeros(1, *x.shape[1:])])
    return rows.index_select(0, index.reshape(-1)).view(*index.shape, *x.shape[1:])


class GatedDeltaNet(nn.Module):
    """Fused input projection (q/k/v, output gate z, beta logits b, decay logits a), short
    conv, the gated delta rule, gated norm, output projection."""

    def __init__(self, hidden_size: int, shape: LinearAttentionConfig, eps: float) -> None:
        super().__init__()
        self.shape = shape
        s = shape
        self.splits = [s.conv_channels, s.value_size, s.num_value_heads, s.num_value_heads]
        self.in_proj = Linear(hidden_size, sum(self.splits), bias=False)
        self.conv1d_weight = nn.Parameter(torch.empty(s.conv_channels, 1, s.conv_kernel))
        self.dt_bias = nn.Parameter(torch.ones(s.num_value_heads))
        self.A_log = nn.Parameter(torch.zeros(s.num_value_heads))
        self.norm = GatedRMSNorm(s.value_head_dim, eps)
        self.out_proj = Linear(s.value_size, hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        conv_pool: torch.Tensor,
        state_pool: torch.Tensor,
        meta: LinearAttentionMetadata,
    ) -> torch.Tensor:
        s = self.shape
        tokens = x.shape[0]
        mixed, z, b, a = self.in_proj(x).split(self.splits, dim=-1)
        states = conv_pool.index_select(0, meta.read_slots)
        mixed, new_states = causal_conv(
            mixed, self.conv1d_weight, states, meta.conv_windows, meta.conv_keep
        )
        conv_pool.index_copy_(0, meta.write_slots, new_states)
        q, k, v = mixed.split([s.key_size, s.key_size, s.value_size], dim=-1)
        q = _l2norm(q.reshape(tokens, s.num_key_heads, s.key_head_dim).float())
        k = _l2norm(k.reshape(tokens, s.num_key_heads, s.key_head_dim).float())
        group = s.num_value_heads // s.num_key_heads
        if group > 1:  # each key head serves consecutive value heads
            q, k = q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)
        q = q * s.key_head_dim**-0.5
        v = v.reshape(tokens, s.num_value_heads, s.value_head_dim).float()
        beta = b.sigmoid().float()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        out = delta_rule(q, k, v, g, beta, state_pool, meta).to(x.dtype)
        out = self.norm(out, z.reshape(tokens, s.num_value_heads, s.value_head_dim))
        return self.out_proj(out.reshape(tokens, s.value_size))


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)
