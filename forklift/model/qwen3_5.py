"""Qwen3.5: a hybrid stack of Gated DeltaNet (linear attention) and gated full attention.

`layer_types` places the two (by default three linear layers, then one full). Full-attention
layers read the paged KV cache like the Llama family's, with three differences: q_proj also
yields an output gate per head (the output is multiplied by its sigmoid), only the first
`partial_rotary_factor` of each head is rotated, and norms scale by 1 + w. Linear layers keep
a per-sequence state instead of a cache (layers/gated_deltanet.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from forklift.model.layers.attention import AttentionMetadata, paged_attention, write_kv
from forklift.model.layers.decode_attention import DecodeKernel, gathered_decode_attention
from forklift.model.layers.gated_deltanet import GatedDeltaNet
from forklift.model.layers.rotary import apply_partial_rotary
from forklift.model.llama import (
    MLP,
    Attention,
    LayerCache,
    LayerRegions,
    LlamaForCausalLM,
    reduce_partial_sums,
    rms_norm,
)
from forklift.model.model_config import FULL_ATTENTION, ModelConfig

if TYPE_CHECKING:
    from forklift.model.tp_group import TensorParallelGroup


class HybridDecoderLayer(nn.Module):
    tp: TensorParallelGroup | None = None  # set for tensor parallelism: partial sums reduced
    decode_attention: DecodeKernel = staticmethod(gathered_decode_attention)

    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__()
        self.is_full_attention = config.layer_type(index) == FULL_ATTENTION
        self.input_layernorm = rms_norm(config, config.hidden_size)
        if self.is_full_attention:
            self.self_attn = Attention(config)
        else:
            assert config.linear_attention is not None
            self.linear_attn = GatedDeltaNet(
                config.hidden_size, config.linear_attention, config.rms_norm_eps
            )
        self.post_attention_layernorm = rms_norm(config, config.hidden_size)
        self.mlp = MLP(config)

    def forward(
        self,
        hidden: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: LayerCache,
        meta: AttentionMetadata,
        regions: LayerRegions,
    ) -> torch.Tensor:
        # `regions` (compiled dense regions) is a Llama-layer notion: hybrid steps run eagerly.
        x = self.input_layernorm(hidden)
        if self.is_full_attention:
            mixed = self._attend(x, rope, cache, meta)
        else:
            assert meta.linear is not None
            conv_pool, state_pool = cache
            mixed = self.linear_attn(x, conv_pool, state_pool, meta.linear)
        hidden = hidden + reduce_partial_sums(self.tp, mixed)
        return hidden + reduce_partial_sums(
            self.tp, self.mlp(self.post_attention_layernorm(hidden))
        )

    def _attend(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: LayerCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        attn = self.self_attn
        tokens = x.shape[0]
        query_gate, k, v = attn.qkv_proj(x).split(
            [2 * attn.q_size, attn.kv_size, attn.kv_size], dim=-1
        )
        # q_proj's rows alternate per head: head_dim queries, then head_dim gate values.
        query_gate = query_gate.view(tokens, attn.num_heads, 2 * attn.head_dim)
        q, gate = query_gate.split(attn.head_dim, dim=-1)
        assert attn.q_norm is not None and attn.k_norm is not None  # Qwen3.5 has q/k norms
        q = attn.q_norm(q)
        k = attn.k_norm(k.view(tokens, attn.num_kv_heads, attn.head_dim))
        v = v.view(tokens, attn.num_kv_heads, attn.head_dim)
        q, k = apply_partial_rotary(q, k, *rope)
        key_cache, value_cache = cache
        write_kv(key_cache, value_cache, k, v, meta.slot_mapping)
        out = paged_attention(
            q.contiguous(), key_cache, value_cache, meta, attn.scale, self.decode_attention
        )
        out = out * torch.sigmoid(gate.reshape(tokens, attn.q_size))
        return attn.o_proj(out)


class Qwen3_5ForCausalLM(LlamaForCausalLM):
    """The Llama model's embedding, logits and weight handling around hybrid layers."""

    @staticmethod
    def build_layer(config: ModelConfig, index: int) -> nn.Module:
        return HybridDecoderLayer(config, index)
