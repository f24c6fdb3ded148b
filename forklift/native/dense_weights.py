"""Dense bf16 weights for the native decode step (csrc/dense_matmul.h: AMX tiles, or
AVX512-BF16 dot products on the same tiles): the packed layout and the exported matmul that
tests and benchmarks call."""

from __future__ import annotations

import ctypes
import itertools
import math

import torch
import torch.nn.functional as F

from forklift.native.build import load_native_library
from forklift.native.huge_pages import huge_page_buffer


def packed_shape(n: int, k: int) -> tuple[int, ...]:
    """The packed layout of an [n, k] weight: [N/16, K/32, 16 input pairs, 16 outputs, 2],
    N padded to a multiple of 32 (blocks go in pairs) and K of 32."""
    return (-(-n // 32) * 2, -(-k // 32), 16, 16, 2)


def pack_dense(weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """[N, K] weights as bf16 tdpbf16ps B tiles (`packed_shape`), zero-padded; into `out`
    (bf16, that shape) where given."""
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D, got shape {tuple(weight.shape)}")
    n, k = weight.shape
    padded = F.pad(weight.detach().to(torch.bfloat16), (0, -k % 32, 0, -n % 32))
    blocks_n, blocks_k = padded.shape[0] // 16, padded.shape[1] // 32
    # Input pairs as one int32 each: the permute moves 4-byte elements, not 2-byte ones.
    pairs = padded.view(torch.int32).view(blocks_n, 16, blocks_k, 16).permute(0, 2, 3, 1)
    if out is None:
        return pairs.contiguous().view(torch.bfloat16).view(packed_shape(n, k))
    out.view(torch.int32).view(pairs.shape).copy_(pairs)
    return out


def pack_dense_all(
    weights: list[torch.Tensor], reuse: torch.Tensor | None = None
) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """Each weight packed, all in one buffer on huge pages where the OS grants them (a step
    streams every weight once: 4 KiB pages cost page walks). `reuse`: the buffer an earlier
    call returned, packed into again when the sizes match (weight updates: no fresh pages to
    fault in). Returns the packed weights and their buffer (None: packed one by one)."""
    shapes = [packed_shape(*w.shape) for w in weights]
    sizes = [math.prod(shape) for shape in shapes]
    total = 2 * sum(sizes)
    buffer = reuse if reuse is not None and reuse.numel() == total else huge_page_buffer(total)
    if buffer is None:
        return [pack_dense(w) for w in weights], None
    flat = buffer.view(torch.bfloat16)
    starts = list(itertools.accumulate(sizes, initial=0))[:-1]
    packed = [
        pack_dense(w, flat[start : start + size].view(shape))
        for w, shape, size, start in zip(weights, shapes, sizes, starts, strict=True)
    ]
    return packed, buffer


class DenseMatmulKernel:
    """The exported dense matmul; construct through `load()`, None where the CPU has neither
    AMX-BF16 nor AVX512-BF16."""

    def __init__(self, library: ctypes.CDLL) -> None:
        function = library.forklift_dense_matmul
        function.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                             ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]  # fmt: skip
        function.restype = ctypes.c_int
        self._function = function

    @classmethod
    def load(cls, arch: tuple[str, ...] | None = None) -> DenseMatmulKernel | None:
        library = load_native_library("dense_matmul", arch)
        if library is None or not library.forklift_dense_tiles_available():
            return None
        return cls(library)

    def __call__(self, x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
        """x [rows, K] (any float dtype; rounded to bf16) @ W.T -> [rows, N] float32."""
        x = x.to(torch.float32).contiguous()
        rows, k = x.shape
        if tuple(packed.shape) != packed_shape(out_features, k):
            raise ValueError(
                f"packed weight of shape {tuple(packed.shape)} is not an [{out_features}, {k}] "
                f"weight's {packed_shape(out_features, k)}"
            )
        if packed.dtype != torch.bfloat16 or not packed.is_contiguous():
            raise ValueError("the packed weight must be contiguous bf16 (pack_dense's output)")
        out = torch.empty(rows, out_features, dtype=torch.float32)
        failed = self._function(x.data_ptr(), rows, k, packed.data_ptr(), out_features,
                                out.data_ptr(), torch.get_num_threads())  # fmt: skip
        if failed:
            raise MemoryError("the dense matmul could not allocate its scratch")
        return out
