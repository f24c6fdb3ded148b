"""The KV cache on the device: every layer's K/V blocks in one tensor and, for a hybrid model,
its linear layers' state slots; which blocks were never written, and the writes a step needs
before its forward (fresh blocks zeroed, blocks and state slots copied)."""

from __future__ import annotations

import numpy as np
import torch

from forklift.model.kv_cache_dtype import KVCacheFormat
from forklift.model.kv_layout import KVLayout
from forklift.model.llama import LayerCache
from forklift.model.model_config import ModelConfig
from forklift.runner.memory import RECURRENT_STATE_DTYPE


class CacheTensors:
    """One runner's cache tensors, allocated and freed whole. `layer_caches` is what the model
    reads: per layer, K and V views, or a linear layer's conv and recurrent states."""

    def __init__(
        self,
        layout: KVLayout,
        kv_format: KVCacheFormat,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.layout = layout
        self.kv_format = kv_format
        self.block_size = block_size
        self.dtype = dtype  # the state slots' conv history
        self.device = device
        self.layer_caches: list[LayerCache] = []
        self.blocks: torch.Tensor | None = None
        self.conv_states: torch.Tensor | None = None
        self.recurrent_states: torch.Tensor | None = None
        self._unwritten = np.zeros(0, dtype=bool)

    def allocate(self, config: ModelConfig, num_blocks: int, num_state_slots: int) -> None:
        """`config`: this rank's shape (its KV heads)."""
        layout = self.layout
        # A block spans the layers of one KV group, each layer in its slot (model/kv_layout.py).
        # KV head outermost: one head's blocks, gathered, are one [context, head_dim] matrix
        # (layers/decode_attention.py).
        shape = (
            layout.layers_per_block, 2, config.num_kv_heads, num_blocks, self.block_size,
            self.kv_format.row_elements(config.head_dim),
        )  # fmt: skip
        # torch.empty leaves pages untouched until a block is first used; only the null
        # block, which pads every read, must hold zeros (others are zeroed on first use).
        cache = torch.empty(shape, dtype=self.kv_format.storage, device=self.device)
        cache[:, :, :, 0].zero_()
        self._unwritten = np.ones(num_blocks, dtype=bool)
        self._unwritten[0] = False
        self.blocks = cache
        caches: dict[int, LayerCache] = {}
        for group in layout.groups:
            for slot, layer in enumerate(group.layers):
                caches[layer] = (cache[slot, 0], cache[slot, 1])
        caches.update(self._allocate_states(config, num_state_slots))
        self.layer_caches = [caches[i] for i in range(config.num_layers)]

    def _allocate_states(self, config: ModelConfig, num_slots: int) -> dict[int, LayerCache]:
        """Per-sequence state slots of a hybrid model's linear layers (plus the zero slot)."""
        shape = config.linear_attention
        if shape is None or not config.is_hybrid:
            return {}
        layers, slots = len(config.linear_layers), num_slots + 1
        history = shape.conv_kernel - 1
        conv = torch.zeros(layers, slots, history, shape.conv_channels, dtype=self.dtype,
                           device=self.device)  # fmt: skip
        recurrent = torch.zeros(
            layers, slots, shape.num_value_heads, shape.key_head_dim, shape.value_head_dim,
            dtype=RECURRENT_STATE_DTYPE, device=self.device,
        )  # fmt: skip
        self.conv_states, self.recurrent_states = conv, recurrent
        return {layer: (conv[i], recurrent[i]) for i, layer in enumerate(config.linear_layers)}

    def free(self) -> None:
        self.layer_caches = []
        self.blocks = None
        self.conv_states = self.recurrent_states = None
        self._unwritten = np.zeros(0, dtype=bool)

    @property
    def nbytes(self) -> int:
        """The KV blocks and, for a hybrid model, its state slots."""
        tensors = (self.blocks, self.conv_states, self.recurrent_states)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def take_unwritten(self, table: np.ndarray) -> np.ndarray:
        """The blocks of `table` never used since the cache was allocated, now marked used."""
        if not self._unwritten.size:
            return np.zeros(0, dtype=np.int64)
        # Look up every entry, sort only the few new ones (most steps have none).
        fresh = np.unique(table[self._unwritten[table]])
        self._unwritten[fresh] = False
        return fresh

    def mark_written(self, blocks: np.ndarray) -> None:
        """A copy fills its target whole: never zero it over the copy, now or later."""
        if blocks.size and self._unwritten.size:
            self._unwritten[blocks] = False

    def write_before_step(
        self,
        fresh_blocks: torch.Tensor,
        state_copies: torch.Tensor | None,
        block_copies: torch.Tensor | None,
    ) -> None:
        """Zero the blocks a step reads first, then copy state slots and blocks, each a
        [n, 2] tensor of (source, target) pairs (call under inference mode)."""
        if fresh_blocks.numel() and self.blocks is not None:
            # Block by block, as the copies below: index_fill_ along the block dimension
            # took 3-4x as long.
            for block in fresh_blocks.tolist():
                self.blocks[:, :, :, block].zero_()
        if state_copies is not None and state_copies.numel():
            # One pair at a time, in order: a checkpoint taken from a slot is copied before a
            # later pair writes that slot, and a restore reads a checkpoint copied before it.
            for source, target in state_copies.tolist():
                for states in (self.conv_states, self.recurrent_states):
                    if states is not None:
                        states[:, target].copy_(states[:, source])
        if block_copies is not None and self.blocks is not None:
            cache = self.blocks
            # Block by block: index_copy_ along the block dimension is ten times slower.
            for source, target in block_copies.tolist():
                cache[:, :, :, target].copy_(cache[:, :, :, source])
