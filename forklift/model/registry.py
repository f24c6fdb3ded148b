"""The model class each architecture runs on, and a model built from a config with its
weights: the one place an architecture name picks code."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType

import torch

from forklift.model.gemma3 import Gemma3ForCausalLM
from forklift.model.llama import LlamaForCausalLM
from forklift.model.model_config import ModelConfig
from forklift.model.qwen3_5 import Qwen3_5ForCausalLM
from forklift.model.tensor_parallel import TensorParallelShard

# Architectures whose model class is not the plain Llama one.
_MODEL_CLASSES: Mapping[str, type[LlamaForCausalLM]] = MappingProxyType(
    {"qwen3_5": Qwen3_5ForCausalLM, "gemma3": Gemma3ForCausalLM}
)


def model_class(config: ModelConfig) -> type[LlamaForCausalLM]:
    """By architecture, not by layer mix: a Qwen3.5 config of only full-attention layers still
    has gated attention and zero-centred norms."""
    return _MODEL_CLASSES.get(config.architecture, LlamaForCausalLM)


def build_model(
    config: ModelConfig,
    weights: Callable[..., Iterable[tuple[str, torch.Tensor]]],
    device: torch.device,
    dtype: torch.dtype,
    max_positions: int,
    shard: TensorParallelShard | None = None,
    from_blocks: Callable[[LlamaForCausalLM], set[str]] | None = None,
) -> LlamaForCausalLM:
    """The model with its weights. `from_blocks` gives layers their quantized copies straight
    from the file before anything loads and names the checkpoint tensors that fed them:
    those are never loaded dense (`weights(skip=...)` leaves them out)."""
    # The layers skip random initialisation (the checkpoint fills every weight), so the model
    # is built where it runs. Not on the meta device: its ops run Python reference kernels
    # that import torch._dynamo, seconds of every start-up.
    with torch.device(device):
        model = model_class(config)(config, max_positions, shard)
    served = from_blocks(model) if from_blocks is not None else set()
    model = model.to(dtype)
    model.load_weights(weights(skip=served) if served else weights())
    model.pack_weights()
    # Rotary tables stay float32 (the cast above lowered them with the weights).
    with torch.device(device):
        model.make_rotary(max_positions)
    return model.eval()
