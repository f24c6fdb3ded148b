"""The checkpoint's tensor table (checkpoint/tensors.py) for one model config: which tensors
the model has, each one's full shape, and its slot in forklift's model."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from forklift.checkpoint.tensors import (
    TENSORS,
    CheckpointTensor,
    Dim,
    Needs,
    Scope,
    canonical_name,
    find,
    is_derived,
    is_unused,
)
from forklift.model.model_config import LINEAR_ATTENTION, ModelConfig


@dataclass(frozen=True)
class WeightSlot:
    """Where one HF tensor lives in forklift's model: a parameter, or rows of a fused one."""

    param: str
    row_offset: int = 0
    rows: int | None = None  # None: the whole parameter

    @property
    def key(self) -> str:
        return f"{self.param}@{self.row_offset}"

    def view(self, data: torch.Tensor) -> torch.Tensor:
        if self.rows is None:
            return data
        return data[self.row_offset : self.row_offset + self.rows]


def sizes(config: ModelConfig) -> dict[Dim, int]:
    """The table's named sizes for this config (a tensor-parallel rank's local one gives its
    shard's sizes)."""
    resolved = {
        Dim.HIDDEN: config.hidden_size,
        Dim.VOCAB: config.vocab_size,
        Dim.HEAD: config.head_dim,
        Dim.Q: config.q_size,
        Dim.Q_PROJ: config.q_proj_size,
        Dim.KV: config.kv_size,
        Dim.INTERMEDIATE: config.intermediate_size,
    }
    linear = config.linear_attention
    if linear is not None:
        resolved |= {
            Dim.CONV_CHANNELS: linear.conv_channels,
            Dim.CONV_KERNEL: linear.conv_kernel,
            Dim.VALUE: linear.value_size,
            Dim.VALUE_HEADS: linear.num_value_heads,
            Dim.VALUE_HEAD: linear.value_head_dim,
        }
    return resolved


def _has(needs: Needs, config: ModelConfig) -> bool:
    if needs is Needs.QKV_BIAS:
        return config.qkv_bias
    if needs is Needs.O_PROJ_BIAS:
        return config.o_proj_bias
    if needs is Needs.QK_NORM:
        return config.qk_norm
    if needs is Needs.SANDWICH_NORMS:
        return config.sandwich_norms
    return not config.tie_word_embeddings  # Needs.UNTIED_HEAD


def _in_model(tensor: CheckpointTensor, layer: int | None, config: ModelConfig) -> bool:
    if tensor.needs is not None and not _has(tensor.needs, config):
        return False
    if layer is None:
        return tensor.scope is Scope.MODEL
    if layer >= config.num_layers:
        return False
    kind = config.layer_type(layer)
    # A sliding-window layer holds the same tensors as a full-attention one.
    mixer = Scope.LINEAR_ATTENTION if kind == LINEAR_ATTENTION else Scope.FULL_ATTENTION
    return tensor.scope in (Scope.LAYER, mixer)


def is_ignored_hf_name(hf_name: str, config: ModelConfig) -> bool:
    """Names a checkpoint may carry that forklift has no use for."""
    if is_derived(hf_name) or is_unused(hf_name):
        return True
    found = find(canonical_name(hf_name))
    if found is None:
        return False
    tensor, layer = found
    return tensor.skipped_without_need and not _in_model(tensor, layer, config)


def model_tensor(hf_name: str, config: ModelConfig) -> tuple[CheckpointTensor, int | None] | None:
    """The table row and layer of an HF name, if this model has that tensor."""
    if is_ignored_hf_name(hf_name, config):
        return None
    found = find(canonical_name(hf_name))
    if found is None or not _in_model(*found, config):
        return None
    return found


def weight_slot(hf_name: str, config: ModelConfig) -> WeightSlot | None:
    """HF parameter name -> its slot in forklift's model; None for names it does not use."""
    found = model_tensor(hf_name, config)
    if found is None:
        return None
    tensor, layer = found
    param = tensor.param_name(layer)
    if tensor.fused_after is None:
        return WeightSlot(param)
    resolved = sizes(config)
    offset = sum(resolved[dim] for dim in tensor.fused_after)
    return WeightSlot(param, offset, _size(tensor.shape[0], resolved))


def hf_tensor_shape(hf_name: str, config: ModelConfig) -> tuple[int, ...] | None:
    """The full (unsharded) shape of an HF tensor; None for a name the model does not have."""
    found = model_tensor(hf_name, config)
    if found is None:
        return None
    resolved = sizes(config)
    return tuple(_size(dim, resolved) for dim in found[0].shape)


def expected_hf_names(config: ModelConfig) -> list[str]:
    """Every tensor a complete checkpoint of this model holds."""
    layers: list[int | None] = [None, *range(config.num_layers)]
    return [
        tensor.hf_name(layer)
        for layer in layers
        for tensor in TENSORS
        if _in_model(tensor, layer, config)
    ]


def _size(dim: Dim | int, resolved: dict[Dim, int]) -> int:
    return dim if isinstance(dim, int) else resolved[dim]
