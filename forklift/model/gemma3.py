"""Gemma 3: the Llama layer's projections with sandwich norms, interleaved window sizes and a
scaled embedding.

Differences from the Llama family, all per Gemma 3's reference implementation:
- norms scale by 1 + w (zero-centred), and besides the two pre-norms the outputs of attention
  and of the MLP are normed too before each residual add (four norms per layer);
- most layers attend to the last `sliding_window` positions only, with their own rotary
  base (`local_rope_theta`); every sixth (by default) attends to the whole context;
- q and k are RMS-normed per head, and logits are scaled by `query_pre_attn_scalar ** -0.5`;
- the MLP gates with tanh-approximated GELU; the embedding is multiplied by sqrt(hidden)
  (rounded to the model's dtype first, as the reference does).
"""

from __future__ import annotations

import torch
from torch import nn

from forklift.model.kv_layout import kv_layout
from forklift.model.layers.attention import AttentionMetadata, paged_attention, write_kv
from forklift.model.layers.decode_attention import DecodeKernel, gathered_decode_attention
from forklift.model.layers.rotary import RotaryEmbedding
from forklift.model.llama import (
    MLP,
    Attention,
    LayerCache,
    LayerRegions,
    LlamaForCausalLM,
    attention_input,
    rms_norm,
)
from forklift.model.model_config import SLIDING_ATTENTION, ModelConfig


class Gemma3DecoderLayer(nn.Module):
    tp = None  # set by LlamaForCausalLM.set_tensor_parallel_group
    decode_attention: DecodeKernel = staticmethod(gathered_decode_attention)

    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__()
        self.is_sliding = config.layer_type(index) == SLIDING_ATTENTION
        # The KV group whose blocks (and window) this layer reads.
        self.kv_group = kv_layout(config).place(index)[0]
        hidden = config.hidden_size
        self.input_layernorm = rms_norm(config, hidden)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = rms_norm(config, hidden)
        self.pre_feedforward_layernorm = rms_norm(config, hidden)
        self.mlp = MLP(config)
        self.post_feedforward_layernorm = rms_norm(config, hidden)

    def forward(
        self,
        hidden: torch.Tensor,
        ropes: tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
        kv_cache: LayerCache,
        meta: AttentionMetadata,
        regions: LayerRegions,
    ) -> torch.Tensor:
        # `regions` (compiled Llama-layer regions) does not apply: Gemma steps run eagerly.
        global_rope, local_rope = ropes
        rope = local_rope if self.is_sliding else global_rope
        q, k, v = attention_input(self, hidden, *rope)  # type: ignore[arg-type]
        group = meta.kv_groups[self.kv_group] if meta.kv_groups else meta
        key_cache, value_cache = kv_cache
        write_kv(key_cache, value_cache, k, v, group.slot_mapping)
        attn = paged_attention(
            q, key_cache, value_cache, group, self.self_attn.scale, self.decode_attention
        )
        attn = self.post_attention_layernorm(self._reduce(self.self_attn.o_proj(attn)))
        hidden = hidden + attn
        mlp = self._reduce(self.mlp(self.pre_feedforward_layernorm(hidden)))
        return hidden + self.post_feedforward_layernorm(mlp)

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """Row-parallel layers give each rank a partial sum; add them up across ranks."""
        return partial if self.tp is None else self.tp.all_reduce(partial)


class Gemma3ForCausalLM(LlamaForCausalLM):
    """The Llama model's logits and weight handling around Gemma 3 layers, with a second
    rotary table for the sliding-window layers."""

    def make_rotary(self, max_positions: int) -> None:
        super().make_rotary(max_positions)
        self.local_rotary = local_rotary(self.full_config, max_positions)

    @staticmethod
    def build_layer(config: ModelConfig, index: int) -> nn.Module:
        return Gemma3DecoderLayer(config, index)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        layer_caches: list[LayerCache],
        meta: AttentionMetadata,
        regions: LayerRegions | None = None,
    ) -> torch.Tensor:
        hidden = self._embed(input_ids)
        scale = torch.tensor(self.config.embedding_multiplier, dtype=hidden.dtype)
        hidden = hidden * scale
        ropes = (
            self.rotary.cos_sin(positions, hidden.dtype),
            self.local_rotary.cos_sin(positions, hidden.dtype),
        )
        for layer, cache in zip(self.layers, layer_caches, strict=True):
            hidden = layer(hidden, ropes, cache, meta, regions)
        return self.norm(hidden)


def local_rotary(config: ModelConfig, max_positions: int) -> RotaryEmbedding:
    """The sliding-window layers' rotary table: their own base, no scaling."""
    theta = config.local_rope_theta or config.rope_theta
    return RotaryEmbedding(config.rotary_dim, max_positions, theta, None)
