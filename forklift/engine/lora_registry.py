"""The engine's LoRA adapters by name and id: registration (read and checked by the
runner), weight pushes, removal, and the prefix-cache key each adapter's requests use."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from forklift.core.lora_slots import LoRASlotTable
from forklift.lora_request import LoRARequest
from forklift.runner.lora_store import LoRAStore


@dataclass(frozen=True)
class LoRAInfo:
    """What /v1/models and /status show of a loaded adapter."""

    name: str
    lora_int_id: int
    path: str
    version: int


class LoRARegistry:
    def __init__(self, store: LoRAStore, slots: LoRASlotTable, users: Callable[[int], int]) -> None:
        self.store = store
        self.slots = slots
        self._users = users  # unfinished sequences running an adapter id
        self._by_id: dict[int, LoRARequest] = {}
        self._versions: dict[int, int] = {}
        # Each registration and each weight push gets a new generation: the prefix cache
        # keys on it, so blocks never pass between two adapters that had the same id (one
        # removed, another added) nor across an update.
        self._generations: dict[int, int] = {}
        self._next_generation = 0
        self._next_id = 1

    def add(self, request: LoRARequest) -> int:
        """Register (or find) an adapter; a bad one raises ValueError and registers nothing.
        Returns its id."""
        known = self._by_id.get(request.lora_int_id)
        if known == request:
            return request.lora_int_id
        if known is not None:
            raise ValueError(
                f"lora_int_id {request.lora_int_id} already names adapter "
                f"{known.lora_name!r} ({known.lora_path!r}), not {request.lora_name!r} "
                f"({request.lora_path!r})"
            )
        named = self.by_name(request.lora_name)
        if named is not None and named.lora_int_id != request.lora_int_id:
            raise ValueError(
                f"lora_name {request.lora_name!r} is already loaded with lora_int_id "
                f"{named.lora_int_id}"
            )
        self.store.register(request)  # reads and checks it
        self._by_id[request.lora_int_id] = request
        self._versions.setdefault(request.lora_int_id, 0)
        self._new_generation(request.lora_int_id)
        self._next_id = max(self._next_id, request.lora_int_id + 1)
        return request.lora_int_id

    def _new_generation(self, adapter_id: int) -> None:
        self._generations[adapter_id] = self._next_generation
        self._next_generation += 1

    def next_id(self) -> int:
        """An id no adapter of this engine has had (for adapters loaded by name and path)."""
        return self._next_id

    def by_name(self, name: str) -> LoRARequest | None:
        # A snapshot of the values: the server's event loop asks while the engine thread
        # may be adding or removing an adapter.
        return next((r for r in tuple(self._by_id.values()) if r.lora_name == name), None)

    def resolve(self, adapter: str | int) -> LoRARequest:
        found = self._by_id.get(adapter) if isinstance(adapter, int) else self.by_name(adapter)
        if found is None:
            raise ValueError(f"no LoRA adapter {adapter!r} is loaded")
        return found

    def remove(self, adapter: str | int) -> LoRARequest:
        request = self.resolve(adapter)
        adapter_id = request.lora_int_id
        if self._users(adapter_id):
            raise ValueError(
                f"LoRA adapter {request.lora_name!r} is in use by {self._users(adapter_id)} "
                "unfinished request(s); wait for them or abort them first"
            )
        self.slots.evict(adapter_id)
        self.store.forget(adapter_id)
        del self._by_id[adapter_id]
        self._versions.pop(adapter_id, None)
        self._generations.pop(adapter_id, None)
        return request

    def update(self, adapter: str | int, tensors: Mapping[str, torch.Tensor]) -> int:
        """Replace an adapter's weights; requests running it continue with the new ones
        from the next step. Returns its new version."""
        request = self.resolve(adapter)
        adapter_id = request.lora_int_id
        self.store.update(adapter_id, tensors)
        self.slots.reload(adapter_id)
        self._versions[adapter_id] += 1
        self._new_generation(adapter_id)
        return self._versions[adapter_id]

    def cache_key_part(self, adapter_id: int) -> tuple[int, int]:
        """Cached blocks are reused only by requests of the same adapter's same weights."""
        return adapter_id, self._generations[adapter_id]

    def infos(self) -> list[LoRAInfo]:
        return [
            LoRAInfo(r.lora_name, r.lora_int_id, r.lora_path, self._versions.get(r.lora_int_id, 0))
            for r in sorted(tuple(self._by_id.values()), key=lambda r: r.lora_int_id)
        ]
