"""Weight updates from a trainer: validate every tensor first, then swap them in at once.

Tensors arrive under Hugging Face parameter names, in any order, in one call or several.
Each is checked (known name, exact shape, floating-point dtype) and staged as a copy in the
model's dtype; nothing touches the model until `commit`. A bad tensor discards the whole
pending update, so the model is never left half old and half new.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from forklift.model.llama import LlamaForCausalLM
from forklift.model.weight_slots import (
    WeightSlot,
    expected_hf_names,
    hf_tensor_shape,
    is_ignored_hf_name,
    weight_slot,
)


class WeightUpdater:
    """Takes full HF tensors; a tensor-parallel rank keeps only its shard of each."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        self._model = model
        self._config = model.full_config
        self._staged: dict[str, tuple[WeightSlot, torch.Tensor]] = {}

    @property
    def num_staged(self) -> int:
        return len(self._staged)

    @property
    def staged_params(self) -> set[str]:
        """The model parameters the pending update writes to."""
        return {slot.param for slot, _ in self._staged.values()}

    @property
    def partly_staged_params(self) -> set[str]:
        """Staged parameters the update writes only some rows of (parts of a fused one)."""
        config = self._model.config
        slots = [weight_slot(name, config) for name in expected_hf_names(config)]
        staged = {slot.key for slot, _ in self._staged.values()}
        return {s.param for s in slots if s is not None and s.key not in staged} & (
            self.staged_params
        )

    def stage(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Check and stage tensors; returns how many are pending. Raises ValueError (and
        drops everything pending) on an unknown name, a wrong shape or a wrong dtype."""
        params = dict(self._model.named_parameters())
        try:
            for hf_name, tensor in named_tensors:
                staged = self._check(hf_name, tensor, params)
                if staged is not None:
                    self._staged[hf_name] = staged
        except ValueError:
            self._staged.clear()
            raise
        return len(self._staged)

    def _check(
        self, hf_name: str, tensor: object, params: dict[str, nn.Parameter]
    ) -> tuple[WeightSlot, torch.Tensor] | None:
        if not isinstance(hf_name, str):
            raise ValueError(f"weight names must be strings, got {type(hf_name).__name__}")
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"weight {hf_name!r} is a {type(tensor).__name__}, not a tensor")
        if is_ignored_hf_name(hf_name, self._config):
            return None
        slot = weight_slot(hf_name, self._model.config)  # this rank's rows of a fused param
        full_shape = hf_tensor_shape(hf_name, self._config)
        if slot is None or full_shape is None or slot.param not in params:
            raise ValueError(f"unknown weight name {hf_name!r} for this model")
        if not tensor.dtype.is_floating_point:
            raise ValueError(f"weight {hf_name!r} has dtype {tensor.dtype}, not a float type")
        if tuple(tensor.shape) != full_shape:
            raise ValueError(
                f"weight {hf_name!r} has shape {tuple(tensor.shape)}, expected {full_shape}"
            )
        if self._model.shard is not None:
            tensor = self._model.shard.shard(hf_name, tensor, self._config)
        dest = slot.view(params[slot.param].data)
        # A dense weight dropped for its blocks sits on the meta device: stage where the
        # model runs (commit brings the weight back there first).
        device = self._model.norm.weight.device if dest.is_meta else dest.device
        staged = tensor.detach().to(device=device, dtype=dest.dtype, copy=True)
        if not bool(torch.isfinite(staged).all()):
            raise ValueError(f"weight {hf_name!r} holds NaN or infinite values")
        return slot, staged

    def commit(self) -> int:
        """Copy every staged tensor into the model; returns how many."""
        params = dict(self._model.named_parameters())
        with torch.no_grad():
            for slot, tensor in self._staged.values():
                slot.view(params[slot.param].data).copy_(tensor)
        count = len(self._staged)
        self._staged.clear()
        return count

    def discard(self) -> None:
        self._staged.clear()
