"""Weight-only quantized matmuls on stock PyTorch CPU kernels.

A decode step at small batch reads every weight once, so its time is the bytes of the
weights. 4-bit weights (one scale and one zero per 32 inputs) are about a quarter of bf16's
bytes; ATen's `_weight_int4pack_mm_for_cpu` multiplies them without expanding them, as
`_weight_int8pack_mm` does for int8 weights with one scale per output row. Both kernels are
vectorised for bf16 activations only (fp32 falls to scalar loops), so they compute in bf16
whatever the model's dtype. The packed int4 layout depends on the CPU's instruction set: it
is built at load and never saved.

At many rows the dense GEMM wins (the int4 kernel re-expands its groups for every row
block), so a quantized layer on these kernels keeps its dense weight for prefill chunks and
uses the quantized copy only for steps of at most `QUANTIZED_MAX_ROWS` rows. (Native block
weights that run every step drop the dense weight: see model/quantize.py.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

GROUP_SIZE = 32
# Steps of at most this many rows use the quantized kernels. The int4 kernel's time grows
# with rows (it unpacks per row block): a decode step's linears on the default model take
# 6.0 / 11.1 / 14.5 / 30.5 ms at 1 / 4 / 8 / 16 rows against 14.0 / 13.6 / 15.1 / 17.6 ms for
# oneDNN-packed bf16 (AVX512-BF16 CPU), so it pays up to 8 rows.
QUANTIZED_MAX_ROWS = 8
# The native block kernels (forklift/native/quant_matmul.py) read each block once for all
# rows, so they pay further: up to this many rows.
BLOCK_MAX_ROWS = 16
# Steps of at least this many rows run the PyTorch layers on the dense weights, whatever
# kernel holds the quantized copy, where a dense weight is kept (with one forward the native
# step runs every step on the blocks, and a layer without its dense weight multiplies the
# blocks at any number of rows).
ALWAYS_DENSE_ROWS = max(QUANTIZED_MAX_ROWS, BLOCK_MAX_ROWS) + 1
_INT4_ZERO_POINT = 8


class QuantizedWeight(Protocol):
    """A quantized copy of a [N, K] weight that multiplies steps of at most `max_rows`."""

    form: str  # "int4" or "int8"
    max_rows: int

    @property
    def nbytes(self) -> int: ...

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T in x's dtype."""
        ...


@dataclass(frozen=True)
class Int4Groups:
    """Unpacked 4-bit weights: w[n, k] = (codes[n, k] - 8) * scales[n, g] + zeros[n, g] with
    g = k // 32. GGUF's Q4_0 and Q4_1 blocks are exactly this form."""

    codes: torch.Tensor  # [N, K] uint8 in 0..15
    scales: torch.Tensor  # [N, K / 32] float32
    zeros: torch.Tensor  # [N, K / 32] float32

    @property
    def shape(self) -> tuple[int, int]:
        return (self.codes.shape[0], self.codes.shape[1])

    def dequantize(self) -> torch.Tensor:
        n, k = self.shape
        grouped = self.codes.view(n, k // GROUP_SIZE, GROUP_SIZE).float() - _INT4_ZERO_POINT
        weight = grouped * self.scales[..., None] + self.zeros[..., None]
        return weight.view(n, k)


def cat_groups(parts: list[Int4Groups]) -> Int4Groups:
    """Stack the output rows of several weights (q, k, v into one fused projection)."""
    return Int4Groups(
        torch.cat([p.codes for p in parts]),
        torch.cat([p.scales for p in parts]),
        torch.cat([p.zeros for p in parts]),
    )


@dataclass(frozen=True)
class Int8Blocks:
    """Unpacked 8-bit weights: w[n, k] = codes[n, k] * scales[n, k // 32]. GGUF's Q8_0, Q5_0
    and Q4_0 blocks are exactly this form (`exact`); other block types come rounded to it."""

    codes: torch.Tensor  # [N, K] int8
    scales: torch.Tensor  # [N, K / 32] float32
    exact: bool = True  # the file's own values, not a rounding of them

    @property
    def shape(self) -> tuple[int, int]:
        return (self.codes.shape[0], self.codes.shape[1])

    def dequantize(self) -> torch.Tensor:
        n, k = self.shape
        grouped = self.codes.view(n, k // GROUP_SIZE, GROUP_SIZE).float()
        return (grouped * self.scales[..., None]).view(n, k)


def cat_int8_blocks(parts: list[Int8Blocks]) -> Int8Blocks:
    """Stack the output rows of several weights, as `cat_groups` does."""
    return Int8Blocks(
        torch.cat([p.codes for p in parts]),
        torch.cat([p.scales for p in parts]),
        all(p.exact for p in parts),
    )


def int4_groups_from_dense(weight: torch.Tensor) -> Int4Groups:
    """Round-to-nearest asymmetric 4-bit quantization, per group of 32 inputs (Q4_1's rule:
    the group's minimum maps to code 0 and its maximum to code 15)."""
    n, k = weight.shape
    if k % GROUP_SIZE:
        raise ValueError(f"int4 quantization needs input sizes divisible by {GROUP_SIZE}, got {k}")
    grouped = weight.detach().float().view(n, k // GROUP_SIZE, GROUP_SIZE)
    low = grouped.amin(dim=-1)
    high = grouped.amax(dim=-1)
    step = (high - low) / 15
    safe = torch.where(step > 0, step, torch.ones_like(step))
    codes = ((grouped - low[..., None]) / safe[..., None]).round_().clamp_(0, 15)
    return Int4Groups(codes.to(torch.uint8).view(n, k), step, low + _INT4_ZERO_POINT * step)


@dataclass(frozen=True)
class PackedInt4:
    """Int4 weights in the CPU kernel's packed layout."""

    packed: torch.Tensor
    scales_and_zeros: torch.Tensor  # [K / 32, N, 2] bfloat16
    out_features: int
    form = "int4"
    max_rows = QUANTIZED_MAX_ROWS

    @classmethod
    def pack(cls, groups: Int4Groups) -> PackedInt4:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(groups.codes.to(torch.int32), 1)
        scales_and_zeros = torch.stack([groups.scales.T, groups.zeros.T], dim=-1)
        return cls(packed, scales_and_zeros.to(torch.bfloat16).contiguous(), groups.shape[0])

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            _bf16(x), self.packed, GROUP_SIZE, self.scales_and_zeros
        )
        return out.to(x.dtype)

    @property
    def nbytes(self) -> int:
        return _bytes(self.packed, self.scales_and_zeros)


@dataclass(frozen=True)
class PackedInt8:
    """Int8 weights with one scale per output row (symmetric round-to-nearest)."""

    weight: torch.Tensor  # [N, K] int8
    scales: torch.Tensor  # [N] bfloat16
    form = "int8"
    max_rows = QUANTIZED_MAX_ROWS

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> PackedInt8:
        dense = weight.detach().float()
        scales = dense.abs().amax(dim=1).clamp_min(1e-12) / 127
        codes = (dense / scales[:, None]).round_().clamp_(-127, 127).to(torch.int8)
        return cls(codes.contiguous(), scales.to(torch.bfloat16))

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(_bf16(x), self.weight, self.scales).to(x.dtype)

    @property
    def nbytes(self) -> int:
        return _bytes(self.weight, self.scales)


def _bf16(x: torch.Tensor) -> torch.Tensor:
    """ATen's quantized kernels are vectorised for bf16 activations only."""
    return x.to(torch.bfloat16).contiguous()


def quantized_linear(
    x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None
) -> torch.Tensor:
    """x @ W.T (+ bias) through a quantized kernel, returned in x's dtype."""
    out = weight.linear(x)
    return out if bias is None else out + bias


def int4_kernel_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


def _bytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
