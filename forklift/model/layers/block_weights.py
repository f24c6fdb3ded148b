"""Weights in 32-value blocks, laid out for the native kernel (native/quant_matmul.py).

`BlockInt4` (GGUF's Q4_0 / Q4_1 form: w = code * d + m) and `BlockInt8` (Q8_0's form:
w = code * d, codes -128..127) keep fp16 scales per block, as the file does. A step of 16
rows costs the kernel little more than a step of one; `max_rows` says up to how many rows a
layer uses it (more rows run the dense GEMM, which wins on prefill chunks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from forklift.model.layers.quantized import (
    BLOCK_MAX_ROWS,
    GROUP_SIZE,
    Int4Groups,
    Int8Blocks,
    int4_groups_from_dense,
)
from forklift.native.huge_pages import on_huge_pages
from forklift.native.quant_matmul import QuantMatmulKernel


def _check_input(x: torch.Tensor, in_features: int) -> None:
    if x.dim() != 2 or x.shape[1] != in_features:
        raise ValueError(f"expected input [rows, {in_features}], got {tuple(x.shape)}")


ROW_GROUP = 8  # output rows interleaved in the kernel's layout


def interleave_rows(per_input: torch.Tensor, chunk: int) -> torch.Tensor:
    """[N, K] values (codes, or one scale per block when chunk is 1) in the kernel's row
    group order: [ceil(N / 8), K / (chunk * C), C, 8, chunk] with C chunks per block, rows
    past N zero. For codes chunk is 4 (four inputs per 32-bit lane); for scales 1."""
    n, k = per_input.shape
    groups = -(-n // ROW_GROUP)
    padded = per_input.new_zeros(groups * ROW_GROUP, k)
    padded[:n] = per_input
    per_block = GROUP_SIZE // chunk if chunk > 1 else 1
    view = padded.view(groups, ROW_GROUP, k // (chunk * per_block), per_block, chunk)
    return view.permute(0, 2, 3, 1, 4).contiguous()


def deinterleave_rows(interleaved: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of `interleave_rows`: [N, K] again."""
    groups, blocks, per_block, _, chunk = interleaved.shape
    rows = interleaved.permute(0, 3, 1, 2, 4).reshape(groups * ROW_GROUP, -1)
    return rows[:n]


@dataclass(frozen=True)
class BlockInt4:
    """4-bit codes and fp16 d and m per block of 32 inputs, in the kernel's interleaved
    layout (csrc/quant_matmul.h): w = code * d + m."""

    codes: torch.Tensor  # [N / 8, K / 32, 4, 8, 4] uint8, two codes per byte
    scales: torch.Tensor  # [N / 8, K / 32, 8] float16: d
    mins: torch.Tensor  # [N / 8, K / 32, 8] float16: m
    shape: tuple[int, int]
    kernel: QuantMatmulKernel
    # Finer activations than int8 (csrc/quant_matmul.h, QuantWeight): LM heads, and down
    # projections where the kernels take their precise rows wide (model/quantize.py).
    precise: bool = False
    form = "int4"
    max_rows = BLOCK_MAX_ROWS

    @classmethod
    def from_groups(
        cls, groups: Int4Groups, kernel: QuantMatmulKernel, precise: bool = False
    ) -> BlockInt4:
        n, k = groups.shape
        codes = interleave_rows(groups.codes, 4)  # [G, B, 8 chunks, 8, 4]
        packed = codes[:, :, :4] | (codes[:, :, 4:] << 4)
        mins = groups.zeros - 8 * groups.scales  # Int4Groups centres codes on 8
        # Q4_0 / Q4_1 scales are the file's fp16; Q4_K's d * sc and dmin * m (17-bit products)
        # round here. On Gemma 3 270M Q4_K_M's 27 Q4_K tensors 92% of them do, by at most
        # 4.9e-4 relative (2^-11, none subnormal), which moves a weight by at most 8.1e-4 of
        # its tensor's largest |w| (7.2e-4 relative RMS at worst).
        return cls(
            on_huge_pages(packed.contiguous()),
            interleave_rows(groups.scales.to(torch.float16), 1).flatten(2),
            interleave_rows(mins.to(torch.float16), 1).flatten(2),
            (n, k),
            kernel,
            precise,
        )

    @classmethod
    def from_dense(
        cls, weight: torch.Tensor, kernel: QuantMatmulKernel, precise: bool = False
    ) -> BlockInt4:
        return cls.from_groups(int4_groups_from_dense(weight), kernel, precise)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        _check_input(x, self.shape[1])
        return self.kernel(x, self.codes, self.scales, self.mins, self.shape[0], self.precise)

    def dequantize(self) -> torch.Tensor:
        n, k = self.shape
        codes = torch.cat([self.codes & 0x0F, self.codes >> 4], dim=2)
        codes = deinterleave_rows(codes, n).float()
        scales = deinterleave_rows(self.scales[..., None, :, None], n).float()
        mins = deinterleave_rows(self.mins[..., None, :, None], n).float()
        blocks = codes.view(n, k // GROUP_SIZE, GROUP_SIZE)
        return (blocks * scales[..., None] + mins[..., None]).view(n, k)

    @property
    def nbytes(self) -> int:
        return _bytes(self.codes, self.scales, self.mins)


@dataclass(frozen=True)
class BlockInt8:
    """8-bit codes with an fp16 scale per block of 32 inputs (symmetric round-to-nearest,
    GGUF's Q8_0), in the kernel's interleaved layout."""

    codes: torch.Tensor  # [N / 8, K / 32, 8, 8, 4] int8
    scales: torch.Tensor  # [N / 8, K / 32, 8] float16
    shape: tuple[int, int]
    kernel: QuantMatmulKernel
    precise: bool = False  # as BlockInt4's
    form = "int8"
    max_rows = BLOCK_MAX_ROWS

    @classmethod
    def from_blocks(
        cls, blocks: Int8Blocks, kernel: QuantMatmulKernel, precise: bool = False
    ) -> BlockInt8:
        """The kernel's layout of unpacked blocks. Their scales become fp16: lossless for
        every Int8Blocks gguf_blocks decodes (a file's fp16 d, or rounded up to fp16)."""
        return cls(
            on_huge_pages(interleave_rows(blocks.codes, 4)),
            interleave_rows(blocks.scales.to(torch.float16), 1).flatten(2),
            blocks.shape,
            kernel,
            precise,
        )

    @classmethod
    def from_dense(
        cls, weight: torch.Tensor, kernel: QuantMatmulKernel, precise: bool = False
    ) -> BlockInt8:
        n, k = weight.shape
        if k % GROUP_SIZE:
            raise ValueError(f"int8 blocks need input sizes divisible by {GROUP_SIZE}, got {k}")
        blocks = weight.detach().float().view(n, k // GROUP_SIZE, GROUP_SIZE)
        # The fp16 scale is what the kernel multiplies by: round with it, not the fp32 one.
        scales = (blocks.abs().amax(dim=-1) / 127).to(torch.float16)
        wide = scales.float()
        safe = torch.where(wide > 0, wide, torch.ones_like(wide))
        codes = (blocks / safe[..., None]).round_().clamp_(-127, 127).to(torch.int8)
        return cls.from_blocks(Int8Blocks(codes.view(n, k), wide, exact=False), kernel, precise)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        _check_input(x, self.shape[1])
        return self.kernel(x, self.codes, self.scales, None, self.shape[0], self.precise)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the weight as float32 (an embedding lookup from a tied head):
        [len(ids), K], each code times its block's scale."""
        groups, lanes = ids // ROW_GROUP, ids % ROW_GROUP
        codes = self.codes[groups, :, :, lanes].float()  # [len, K / 32, 8 chunks, 4]
        scales = self.scales[groups, :, lanes].float()  # [len, K / 32]
        return (codes.flatten(2) * scales[..., None]).flatten(1)

    def dequantize(self) -> torch.Tensor:
        n, k = self.shape
        codes = deinterleave_rows(self.codes, n).float()
        scales = deinterleave_rows(self.scales[..., None, :, None], n).float()
        return (codes.view(n, k // GROUP_SIZE, GROUP_SIZE) * scales[..., None]).view(n, k)

    @property
    def nbytes(self) -> int:
        return _bytes(self.codes, self.scales)


def _bytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
