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
class DecodeGroup:
    """One-token rows of distinct sequences: the recurrent form, batched over them."""

    read_slots: torch.Tensor  # [seqs]: the state each starts from (ZERO_SLOT at position 0)
    write_slots: torch.Tensor  # [seqs]: where its new state goes
    token_index: torch.Tensor  # [seqs]: the flat index of each one's token


@dataclass
class PrefillChunk:
    """One sequence's prompt chunk, rows [first, first + length) of the step: the chunked
    form, alone (padding short chunks to a long one's length would cost as much as it)."""

    read_slot: torch.Tensor  # [1]
    write_slot: torch.Tensor  # [1]
    first: int
    length: int


@dataclass
class LinearAttentionMetadata:
    """Index tensors every Gated DeltaNet layer of one step shares."""

    # [chains]: the convolution state each chain starts from (a chain: one sequence's row,
    # or its rows verifying drafts, which carry on one another), in the step's order.
    read_slots: torch.Tensor
    write_slots: torch.Tensor  # [rows]: where each row's convolution state goes
    # [num_tokens, conv_kernel]: each token's window, indexing cat(states of every chain
    # flattened to [chains * (conv_kernel - 1)], the step's inputs).
    conv_windows: torch.Tensor
    # [rows, conv_kernel - 1]: the inputs kept after each row, indexing the same rows.
    conv_keep: torch.Tensor
    # One-token rows in waves: a wave's rows read the states the wave before wrote.
    decode_waves: list[DecodeGroup]
    prefills: list[PrefillChunk]


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
    waves = meta.decode_waves
    if len(waves) == 1 and not meta.prefills:  # every token, in order: no gather
        decodes = waves[0]
        state = state_pool.index_select(0, decodes.read_slots)
        out, state = recurrent_gated_delta_step(q, k, v, g, beta, state)
        state_pool.index_copy_(0, decodes.write_slots, state)
        return out
    out = v.new_empty(v.shape)
    for decodes in waves:
        state = state_pool.index_select(0, decodes.read_slots)
        inputs = [t.index_select(0, decodes.token_index) for t in (q, k, v, g, beta)]
        result, state = recurrent_gated_delta_step(*inputs, state)
        state_pool.index_copy_(0, decodes.write_slots, state)
        out.index_copy_(0, decodes.token_index, result)
    for chunk in meta.prefills:
        rows = [t.narrow(0, chunk.first, chunk.length)[None] for t in (q, k, v, g, beta)]
        result, state = chunked_gated_delta_rule(*rows, state_pool.index_select(0, chunk.read_slot))
        state_pool.index_copy_(0, chunk.write_slot, state)
        out.narrow(0, chunk.first, chunk.length).copy_(result[0])
    return out


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
