"""Which layers share a KV block: the cache's groups (vLLM's hybrid KV cache manager idea).

A model whose layers all attend to the whole context has one group: a block holds a few
tokens' K/V for every attention layer. Gemma 3 interleaves sliding-window layers, which
never read more than `sliding_window` positions back: giving them blocks of their own lets
their blocks before the window go back to the pool, so a long sequence holds about
window / block_size blocks there instead of its whole context.

All groups draw from one block pool, and every block has the same size: a block spans
`layers_per_block` layers, each group holds that many layers, and a layer's cache is slot
`slot` of the cache tensor ([layers_per_block, 2, kv_heads, blocks, block_size, head_dim]).
Two layers in the same slot of different groups never hold the same block at once, since
a block belongs to one group's table at a time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from forklift.model.model_config import ModelConfig


@dataclass(frozen=True)
class KVGroup:
    layers: tuple[int, ...]
    window: int | None  # None: the layers read the whole context


@dataclass(frozen=True)
class KVLayout:
    groups: tuple[KVGroup, ...]

    @property
    def layers_per_block(self) -> int:
        return len(self.groups[0].layers) if self.groups else 0

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Each group's window; a model without attention layers has one empty group (its
        requests' block tables still need a target)."""
        return tuple(group.window for group in self.groups) or (None,)

    def place(self, layer: int) -> tuple[int, int]:
        """(group, slot) of an attention layer."""
        for index, group in enumerate(self.groups):
            if layer in group.layers:
                return index, group.layers.index(layer)
        raise ValueError(f"layer {layer} has no KV cache")


def kv_layout(config: ModelConfig) -> KVLayout:
    """Full-attention layers first, then sliding-window ones, in groups of as many layers as
    the two counts' greatest common divisor (Gemma 3 270M: 3 full and 15 sliding layers make
    one group of 3 full and five of 3 sliding)."""
    sliding = config.sliding_layers
    full = tuple(i for i in config.attention_layers if i not in sliding)
    if not sliding or not full:
        # One kind of layer: one group (a uniform window, Mistral's, stays a mask over the
        # whole table; only layers named sliding return blocks).
        if not config.attention_layers:
            return KVLayout(())
        window = config.sliding_window if sliding else None
        return KVLayout((KVGroup(config.attention_layers, window),))
    size = math.gcd(len(full), len(sliding))
    groups = [KVGroup(full[i : i + size], None) for i in range(0, len(full), size)]
    groups += [
        KVGroup(sliding[i : i + size], config.sliding_window) for i in range(0, len(sliding), size)
    ]
    return KVLayout(tuple(groups))
