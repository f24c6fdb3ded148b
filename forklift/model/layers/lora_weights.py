"""LoRA slots of one projection: every resident adapter's A and B, and the per-row delta.

A projection fusing several target modules (q, k and v in qkv_proj) holds each module as a
slice: A stacks the slices' ranks, B ([rank, out], rank-major so the native expansion runs
along contiguous outputs) keeps each output's own slice of ranks only (an output belongs to
exactly one slice), so no zero blocks are stored or read. Weights are
float32 whatever the model's dtype: they are small, and the native step reads them as such.

Which slot each row of a step uses is set once per step on the `LoRAContext` every slot
object of the model shares; rows of one adapter are gathered and multiplied together
(the SGMV idea), and base rows cost nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from forklift.model.lora import LoRAModule


@dataclass
class LoRAStepRows:
    """One step's rows by adapter slot."""

    # [tokens] int64: each row's slot, -1 for the base model.
    token_slots: torch.Tensor
    # (slot, its rows: None when every row of the step uses it), one entry per slot used.
    groups: list[tuple[int, torch.Tensor | None]] = field(default_factory=list)


@dataclass
class LoRAContext:
    """The current step's rows, shared by every projection's slots (None: no adapter)."""

    rows: LoRAStepRows | None = None


class LoRASlots:
    def __init__(
        self,
        context: LoRAContext,
        num_slots: int,
        in_features: int,
        slice_sizes: tuple[int, ...],
        max_rank: int,
        device: torch.device,
    ) -> None:
        self.context = context
        self.max_rank = max_rank
        self.slice_sizes = slice_sizes
        self.slice_starts = [sum(slice_sizes[:i]) for i in range(len(slice_sizes) + 1)]
        self.slice_starts_tensor = torch.tensor(self.slice_starts, dtype=torch.int64)
        out_features = self.slice_starts[-1]
        slices = len(slice_sizes)
        self.a = torch.zeros(num_slots, slices * max_rank, in_features, device=device)
        self.b = torch.zeros(num_slots, max_rank, out_features, device=device)
        # [slot, slice] rank of the adapter there (0: that slice is not adapted).
        self.ranks = torch.zeros(num_slots, slices, dtype=torch.int64)
        # The same ranks as Python ints: each projection of each step reads them, and a
        # tensor read there would cost more than the delta of a decode row.
        self._ranks: list[list[int]] = [[0] * slices for _ in range(num_slots)]

    @property
    def nbytes(self) -> int:
        return self.a.nbytes + self.b.nbytes

    def write(self, slot: int, slice_index: int, module: LoRAModule | None) -> None:
        """Put `module` (None: nothing) in `slot`'s slice."""
        rank = 0 if module is None else module.rank
        rows = slice(slice_index * self.max_rank, (slice_index + 1) * self.max_rank)
        outs = slice(self.slice_starts[slice_index], self.slice_starts[slice_index + 1])
        self.a[slot, rows].zero_()
        self.b[slot, :, outs].zero_()
        if module is not None:
            self.a[slot, rows][:rank].copy_(module.a)
            self.b[slot, :rank, outs].copy_(module.b.T)
        self.ranks[slot, slice_index] = rank
        self._ranks[slot][slice_index] = rank

    def add_delta(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out + each row's adapter delta (in place where `out` allows)."""
        rows = self.context.rows
        if rows is None:
            return out
        for slot, index in rows.groups:
            ranks = self._ranks[slot]
            if not any(ranks):
                continue
            inputs = x if index is None else x.index_select(0, index)
            shrunk = F.linear(inputs.to(torch.float32), self.a[slot])
            delta = self._expand(slot, shrunk, ranks).to(out.dtype)
            if index is None:
                out = out + delta
            else:
                out = out.index_add(0, index, delta)
        return out

    def _expand(self, slot: int, shrunk: torch.Tensor, ranks: list[int]) -> torch.Tensor:
        """[rows, out] from the shrunk rows: each slice's outputs from its own ranks."""
        if len(ranks) == 1:
            return shrunk[:, : ranks[0]] @ self.b[slot, : ranks[0]]
        parts = []
        for i, rank in enumerate(ranks):
            width = self.slice_sizes[i]
            if rank == 0:
                parts.append(shrunk.new_zeros(shrunk.shape[0], width))
                continue
            start = i * self.max_rank
            outs = slice(self.slice_starts[i], self.slice_starts[i + 1])
            parts.append(shrunk[:, start : start + rank] @ self.b[slot, :rank, outs])
        return torch.cat(parts, dim=1)
