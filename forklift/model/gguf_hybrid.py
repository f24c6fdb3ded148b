"""llama.cpp's layout of the Qwen3.5 hybrid (`qwen35` GGUF files), mapped back onto HF's.

llama.cpp's converter renames the Gated DeltaNet tensors, stores `-exp(A_log)` instead of
`A_log`, squeezes the convolution kernel, adds one to every zero-centred norm weight (undone
by the loader, as for Gemma 3), and, where a key head serves several value heads, reorders
the value heads from grouped by key head ([k0: v0 v1][k1: v0 v1]) to tiled ([v0: k0 k1]
[v1: k0 k1]) in every tensor with a value-head axis. It appends the multi-token-prediction
layers as extra blocks (`nextn_predict_layers`) after the decoder's own; the model skips them.
Everything here undoes one of those steps, so the model code reads HF names and layouts.
"""

from __future__ import annotations

import numpy as np
import torch

from forklift.model.layers.quantized import GROUP_SIZE
from forklift.model.model_config import LinearAttentionConfig

# llama.cpp's names of the hybrid family: the dense model runs; its MoE sibling does not.
HYBRID_ARCHITECTURE = "qwen35"
MOE_HYBRID_ARCHITECTURES = ("qwen35moe", "qwen3next")

LAYER_TENSORS = {
    "post_attention_norm": "post_attention_layernorm",
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
}
# Tensors stored without the usual .weight suffix, or under another part's name.
SPECIAL_LAYER_TENSORS = {
    "ssm_a": "linear_attn.A_log",
    "ssm_dt.bias": "linear_attn.dt_bias",
}


def to_hf_layout(array: np.ndarray, hf_name: str, shape: LinearAttentionConfig) -> np.ndarray:
    """A dense tensor of a qwen35 file in HF's layout and sign (its norms' 1 + w is the
    loader's shared rule for zero-centred norms)."""
    if ".linear_attn." not in hf_name:
        return array
    if hf_name.endswith("A_log"):
        array = np.log(-array)
    elif hf_name.endswith("conv1d.weight"):
        array = array.reshape(array.shape[0], 1, array.shape[-1])
    permutation = value_head_rows(hf_name, shape)
    if permutation is not None:
        array = array[permutation.numpy()]
    elif hf_name.endswith("out_proj.weight"):
        array = array[:, value_head_order(shape, shape.value_head_dim).numpy()]
    return np.ascontiguousarray(array)


def value_head_order(shape: LinearAttentionConfig, head_size: int) -> torch.Tensor:
    """Indices that turn the file's tiled value heads (each `head_size` long) back into HF's
    grouped order: HF position i reads file position order[i]."""
    per_key = shape.num_value_heads // shape.num_key_heads
    tiled = torch.arange(shape.num_value_heads * head_size).view(
        per_key, shape.num_key_heads, head_size
    )
    return tiled.transpose(0, 1).reshape(-1)


def value_head_rows(hf_name: str, shape: LinearAttentionConfig) -> torch.Tensor | None:
    """The row order that undoes the value-head reordering of a linear layer's tensor whose
    first axis carries value heads, or None for tensors without one (out_proj reorders its
    columns instead)."""
    if ".linear_attn." not in hf_name:
        return None
    if hf_name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
        # q and k channels first, untouched; then the value heads.
        keys = 2 * shape.key_size
        values = value_head_order(shape, shape.value_head_dim) + keys
        return torch.cat([torch.arange(keys), values])
    if hf_name.endswith("in_proj_z.weight"):
        return value_head_order(shape, shape.value_head_dim)
    if hf_name.endswith(("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias")):
        return value_head_order(shape, 1)
    return None


def blocks_to_hf_layout(
    hf_name: str, parts: tuple[torch.Tensor, ...], shape: LinearAttentionConfig
) -> tuple[torch.Tensor, ...] | None:
    """A quantized matrix's per-row parts ([N, K] codes, [N, K / 32] per-group values) in
    HF's order; None where the reordering would cut its 32-value groups (out_proj with a
    value head size that is not a multiple of 32), so the layer rounds its dense weight."""
    rows = value_head_rows(hf_name, shape)
    if rows is not None:
        return tuple(p.index_select(0, rows) for p in parts)
    if hf_name.endswith("linear_attn.out_proj.weight"):
        if shape.value_head_dim % GROUP_SIZE:
            return None
        groups = value_head_order(shape, shape.value_head_dim // GROUP_SIZE)
        columns = value_head_order(shape, shape.value_head_dim)
        codes, *per_group = parts
        return (codes.index_select(1, columns), *(p.index_select(1, groups) for p in per_group))
    return parts
