"""Load a resolved model's config and weights with the loader of its on-disk format."""

from __future__ import annotations

from collections.abc import Collection, Iterator
from functools import partial

import torch

from forklift.checkpoint.source import ModelSource
from forklift.model.gguf_loader import (
    gguf_model_config,
    gguf_tensor_types,
    iter_gguf_int4_groups,
    iter_gguf_int8_blocks,
    iter_gguf_weights,
)
from forklift.model.model_config import ModelConfig
from forklift.model.quantize import NO_QUANTIZATION, QuantizationPlan
from forklift.model.safetensors_loader import iter_safetensors_weights, load_hf_model_config


def load_model_config(source: ModelSource) -> ModelConfig:
    if source.format == "gguf":
        return gguf_model_config(source.gguf_reader())
    if source.format == "hf":
        return load_hf_model_config(source.path)
    raise ValueError(f"unknown model format {source.format!r}")


def iter_model_weights(
    source: ModelSource, config: ModelConfig, skip: Collection[str] = ()
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(hf_name, tensor)` pairs for the model at `source`; a GGUF file leaves out
    those named in `skip` (tensors served from their blocks, never dense)."""
    if source.format == "gguf":
        return iter_gguf_weights(source.gguf_reader(), config, skip)
    if source.format == "hf":
        return iter_safetensors_weights(source.path)
    raise ValueError(f"unknown model format {source.format!r}")


def quantization_plan(source: ModelSource, config: ModelConfig, method: str) -> QuantizationPlan:
    """The plan for a resolved method ("none", "gguf", "int4", "int8"): a GGUF file lends its
    block types, its exact int4 groups and its int8 blocks."""
    if method == "none":
        return NO_QUANTIZATION
    if source.format != "gguf":
        return QuantizationPlan(method)
    reader = source.gguf_reader()
    return QuantizationPlan(
        method,
        gguf_tensor_types(reader, config),
        partial(iter_gguf_int4_groups, reader, config),
        partial(iter_gguf_int8_blocks, reader, config),
    )
