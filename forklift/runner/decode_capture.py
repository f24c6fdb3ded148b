"""Captured decode: a pure-decode step runs at a fixed shape, replayed without host overhead.

A decode batch of n sequences is padded up to the next batch-size bucket, and its attention
context up to the next power-of-two width, so that a handful of static shapes cover every
step. Each shape is captured once, on first use, into static input buffers; later steps copy
their inputs into those buffers and replay. On an NVIDIA GPU a capture is a CUDA graph; on a
CPU it is the model with its per-layer regions compiled (`CompiledCpuBackend`).

Padding rows decode token 0 at position 0 of the null block: they write finite K/V into the
null block's first slot and attend only to that slot, so they never produce NaNs that could
reach a real row through the null block, and their outputs are dropped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from forklift.model.layers.attention import AttentionGroup, AttentionMetadata

# Batch-size buckets up to max_num_seqs (vLLM captures a similar ladder).
_DEFAULT_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
# Attention contexts are padded to a power of two of at least this many positions.
MIN_KV_WIDTH = 64


def capture_sizes(max_num_seqs: int, sizes: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """The batch-size buckets, ascending; the largest covers max_num_seqs where it can."""
    chosen = sorted(set(sizes if sizes is not None else _DEFAULT_SIZES))
    if not chosen or chosen[0] < 1:
        raise ValueError(f"decode_capture_sizes must be positive integers, got {sizes!r}")
    if sizes is None:
        chosen = [s for s in chosen if s < max_num_seqs] + [max_num_seqs]
    return tuple(chosen)


def batch_bucket(sizes: tuple[int, ...], num_seqs: int) -> int | None:
    """The smallest bucket holding num_seqs; None when it exceeds the largest (run eager)."""
    for size in sizes:
        if size >= num_seqs:
            return size
    return None


def kv_width_bucket(max_context: int, max_model_len: int) -> int:
    """Context positions one captured step attends over: a power of two, capped at the
    model's length, so a sequence growing by one token rarely needs a new capture."""
    width = MIN_KV_WIDTH
    while width < max_context:
        width *= 2
    return max(max_context, min(width, max_model_len))


@dataclass(frozen=True)
class CaptureKey:
    batch: int
    kv_width: int


@dataclass
class StaticDecodeInputs:
    """The tensors a captured step reads; refilled in place before every replay."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata

    @classmethod
    def like(
        cls, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> StaticDecodeInputs:
        group = meta.groups[0]
        return cls(
            input_ids.clone(),
            positions.clone(),
            AttentionMetadata(
                meta.slot_mapping.clone(),
                [
                    AttentionGroup(
                        query_index=group.query_index.clone(),
                        padded_index=group.padded_index.clone(),
                        token_index=group.token_index.clone(),
                        kv_blocks=group.kv_blocks.clone(),
                        mask=group.mask.clone(),
                    )
                ],
            ),
        )

    def fill(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> None:
        # query/padded/token indices of a full padded decode batch are always 0..batch-1.
        self.input_ids.copy_(input_ids)
        self.positions.copy_(positions)
        self.meta.slot_mapping.copy_(meta.slot_mapping)
        self.meta.groups[0].kv_blocks.copy_(meta.groups[0].kv_blocks)
        self.meta.groups[0].mask.copy_(meta.groups[0].mask)


# Runs the model on a StaticDecodeInputs and returns its final hidden states.
DecodeForward = Callable[[StaticDecodeInputs], torch.Tensor]


class CaptureBackend(Protocol):
    name: str

    def capture(self, run: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        """Turn `run` (which reads only static buffers) into a replayable callable."""
        ...


@dataclass
class CaptureStats:
    captures: int = 0
    replays: int = 0
    eager_fallbacks: int = 0


class DecodeCapture:
    """Captured decode steps by (batch bucket, context-width bucket)."""

    def __init__(
        self,
        backend: CaptureBackend,
        forward: DecodeForward,
        sizes: tuple[int, ...],
        max_model_len: int,
    ) -> None:
        self.backend = backend
        self.forward = forward
        self.sizes = sizes
        self.max_model_len = max_model_len
        self.stats = CaptureStats()
        self._captured: dict[CaptureKey, tuple[StaticDecodeInputs, Callable[[], torch.Tensor]]]
        self._captured = {}

    def key_for(self, num_seqs: int, max_context: int) -> CaptureKey | None:
        batch = batch_bucket(self.sizes, num_seqs)
        if batch is None:
            return None
        return CaptureKey(batch, kv_width_bucket(max_context, self.max_model_len))

    @property
    def captured_keys(self) -> list[CaptureKey]:
        return list(self._captured)

    def run(
        self,
        key: CaptureKey,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states for the padded batch (inputs already padded to `key`)."""
        entry = self._captured.get(key)
        if entry is None:
            static = StaticDecodeInputs.like(input_ids, positions, meta)
            replay = self.backend.capture(lambda: self.forward(static))
            self._captured[key] = entry = (static, replay)
            self.stats.captures += 1
        static, replay = entry
        static.fill(input_ids, positions, meta)
        self.stats.replays += 1
        return replay()

    def reset(self) -> None:
        """Forget every capture (the KV cache or the weights were reallocated)."""
        self._captured.clear()
