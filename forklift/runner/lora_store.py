"""The runner's adapters: host copies of the known ones (LRU, `max_cpu_loras`), and the
device slots every LoRA'd projection holds (model/layers/lora_weights.py).

Adapters are read and checked when first registered, so a bad one fails its request before
anything is queued. A host copy evicted from the LRU is read again from its directory when
a slot needs it; an adapter whose weights were pushed in (`update`) has no directory to
go back to, so its copy is pinned.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from forklift.core.scheduler_output import ScheduledChunk
from forklift.lora_request import LoRARequest
from forklift.model.layers.lora_weights import LoRAContext, LoRASlots, LoRAStepRows
from forklift.model.lora import PROJECTIONS, LoRAAdapter, build_adapter, load_adapter, target_shapes
from forklift.model.model_config import ModelConfig


@dataclass(frozen=True)
class LoRALimits:
    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int


class LoRAStore:
    def __init__(
        self, model: nn.Module, config: ModelConfig, limits: LoRALimits, device: torch.device
    ) -> None:
        self.config = config
        self.limits = limits
        self.device = device
        self.context = LoRAContext()
        shapes = target_shapes(config)
        # (layer, projection) -> its slots.
        self.slots: dict[tuple[int, str], LoRASlots] = {}
        for index in range(config.num_layers):
            for _, name, modules in PROJECTIONS:
                self.slots[(index, name)] = LoRASlots(
                    self.context, limits.max_loras, shapes[modules[0]][0],
                    tuple(shapes[m][1] for m in modules), limits.max_lora_rank, device,
                )  # fmt: skip
        self.attach(model)
        self._requests: dict[int, LoRARequest] = {}
        self._host: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self._pinned: dict[int, LoRAAdapter] = {}

    def attach(self, model: nn.Module) -> None:
        """Give each LoRA'd projection of `model` its slots."""
        for index, layer in enumerate(model.layers):
            for owner, name, _ in PROJECTIONS:
                getattr(getattr(layer, owner), name).lora = self.slots[(index, name)]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.slots.values())

    def register(self, request: LoRARequest) -> None:
        """Know a new adapter by its id, reading and checking it now (ValueError if bad)."""
        adapter = load_adapter(
            request.lora_path, self.config, self.limits.max_lora_rank, request.lora_name
        )
        self._requests[request.lora_int_id] = request
        self._keep(request.lora_int_id, adapter)

    def forget(self, adapter_id: int) -> None:
        self._requests.pop(adapter_id, None)
        self._host.pop(adapter_id, None)
        self._pinned.pop(adapter_id, None)

    def update(self, adapter_id: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Replace a registered adapter's weights (PEFT-named tensors, its own scaling); a
        slot holding it is refreshed by the next load the scheduler queues."""
        request = self._requests.get(adapter_id)
        if request is None:
            raise ValueError(f"no LoRA adapter with lora_int_id {adapter_id} is loaded")
        scaling = self._adapter(adapter_id).scaling
        adapter = build_adapter(
            request.lora_name, tensors, scaling, self.config, self.limits.max_lora_rank
        )
        self._host.pop(adapter_id, None)
        self._pinned[adapter_id] = adapter

    def load(self, loads: Sequence[tuple[int, int]]) -> None:
        """Write each (slot, adapter id) into every projection's slots."""
        for slot, adapter_id in loads:
            adapter = self._adapter(adapter_id)
            for layer in range(self.config.num_layers):
                for _, name, modules in PROJECTIONS:
                    for index, module in enumerate(modules):
                        part = adapter.modules.get((layer, module))
                        self.slots[(layer, name)].write(slot, index, part)

    def _adapter(self, adapter_id: int) -> LoRAAdapter:
        pinned = self._pinned.get(adapter_id)
        if pinned is not None:
            return pinned
        adapter = self._host.get(adapter_id)
        if adapter is None:  # evicted from host memory: read it again
            request = self._requests[adapter_id]
            adapter = load_adapter(
                request.lora_path, self.config, self.limits.max_lora_rank, request.lora_name
            )
            self._keep(adapter_id, adapter)
        else:
            self._host.move_to_end(adapter_id)
        return adapter

    def _keep(self, adapter_id: int, adapter: LoRAAdapter) -> None:
        self._host[adapter_id] = adapter
        self._host.move_to_end(adapter_id)
        while len(self._host) > self.limits.max_cpu_loras:
            self._host.popitem(last=False)

    def begin_step(self, rows: Sequence[ScheduledChunk]) -> None:
        """Set which slot each token row of the step uses (none when every row is the
        base's)."""
        slots = [row.lora_slot for row in rows]
        if all(slot < 0 for slot in slots):
            self.context.rows = None
            return
        counts = [row.num_new_tokens for row in rows]
        token_slots = np.repeat(np.asarray(slots, dtype=np.int64), counts)
        groups: list[tuple[int, torch.Tensor | None]] = []
        for slot in sorted({s for s in slots if s >= 0}):
            where = np.flatnonzero(token_slots == slot)
            index = None if where.size == token_slots.size else torch.from_numpy(where)
            groups.append((slot, None if index is None else index.to(self.device)))
        self.context.rows = LoRAStepRows(torch.from_numpy(token_slots).to(self.device), groups)

    def end_step(self) -> None:
        self.context.rows = None
