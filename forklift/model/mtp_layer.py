"""Qwen3.5's multi-token prediction (MTP) layer: from the model's final hidden state at
position p and the token at p + 1, a guess at the token at p + 2.

Both inputs are normed (`pre_fc_norm_hidden`, `pre_fc_norm_embedding`, the embedding being
the model's own), concatenated embedding first and projected back to the hidden size
(`fc`); one gated full-attention decoder layer with its own KV cache runs on that at
position p, then a norm; the model's head turns the result into logits. Its normed output
stands in for the hidden state when it guesses again, one position further.

Checkpoint names: `mtp.fc.weight` [hidden, 2 * hidden], `mtp.pre_fc_norm_embedding.weight`,
`mtp.pre_fc_norm_hidden.weight`, `mtp.norm.weight` and `mtp.layers.0.*`, named as a decoder
layer's tensors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch
from torch import nn

from forklift.model.layers.attention import AttentionMetadata
from forklift.model.layers.linear import Linear
from forklift.model.layers.rotary import RotaryEmbedding
from forklift.model.llama import EAGER_REGIONS, LayerCache, rms_norm
from forklift.model.model_config import FULL_ATTENTION, ModelConfig
from forklift.model.qwen3_5 import HybridDecoderLayer
from forklift.model.weight_slots import expected_hf_names, weight_slot

MTP_PREFIXES = ("mtp.", "model.mtp.")


def mtp_name(hf_name: str) -> str | None:
    """The name within the MTP layer of a checkpoint tensor; None for the model's others."""
    for prefix in MTP_PREFIXES:
        if hf_name.startswith(prefix):
            return hf_name[len(prefix) :]
    return None


class MultiTokenPredictor(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        hidden = config.hidden_size
        # The layer's shape: the model's full-attention layers'.
        self.layer_config = dataclasses.replace(config, num_layers=1, layer_types=(FULL_ATTENTION,))
        self.pre_fc_norm_embedding = rms_norm(config, hidden)
        self.pre_fc_norm_hidden = rms_norm(config, hidden)
        self.fc = Linear(2 * hidden, hidden, bias=False)
        self.layers = nn.ModuleList([HybridDecoderLayer(self.layer_config, 0)])
        self.norm = rms_norm(config, hidden)
        self.rotary = RotaryEmbedding(
            config.rotary_dim, max_positions, config.rope_theta, config.rope_scaling
        )

    def forward(
        self,
        embedded: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        cache: LayerCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Normed hidden states [tokens, hidden]: `embedded` is the embedding of the token at
        p + 1, `hidden` the model's (or this layer's previous) output at p, for position p."""
        x = torch.cat([self.pre_fc_norm_embedding(embedded), self.pre_fc_norm_hidden(hidden)], -1)
        x = self.fc(x)
        rope = self.rotary.cos_sin(positions, x.dtype)
        x = self.layers[0](x, rope, cache, meta, EAGER_REGIONS)
        return self.norm(x)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy the checkpoint's `mtp.*` tensors in (others are passed over); every parameter
        must be set. Returns how many tensors were copied."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            name = mtp_name(hf_name)
            if name is None:
                continue
            slot = weight_slot("model." + name, self.layer_config)
            if slot is not None and name.startswith("layers.0."):
                dest, key = slot.view(params[slot.param].data), slot.key
            elif name in params and not name.startswith("layers."):
                dest, key = params[name].data, name
            else:
                raise ValueError(f"checkpoint tensor {hf_name!r} has no place in the MTP layer")
            if dest.shape != tensor.shape:
                raise ValueError(
                    f"checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}, expected "
                    f"{tuple(dest.shape)}"
                )
            dest.copy_(tensor)
            loaded.add(key)
        if not loaded:
            raise ValueError("the checkpoint has no multi-token prediction (mtp.*) tensors")
        missing = sorted(self._expected_keys() - loaded)
        if missing:
            raise ValueError(f"the checkpoint's MTP layer lacks {', '.join(missing[:5])}")
        return len(loaded)

    def _expected_keys(self) -> set[str]:
        keys = {"fc.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight",
                "norm.weight"}  # fmt: skip
        for hf_name in expected_hf_names(self.layer_config):
            slot = weight_slot(hf_name, self.layer_config)
            if slot is not None and hf_name.startswith("model.layers.0."):
                keys.add(slot.key)
        return keys
