"""The native block-quantized matmul (csrc/quant_matmul.h), loaded through ctypes.

The kernel quantizes each activation row to int8 once per call and reads each weight block
once for all rows, so a step of 16 rows costs little more than a step of one. The weights it
reads, in its interleaved layout, are model/layers/block_weights.py's.
"""

from __future__ import annotations

import ctypes
from contextlib import nullcontext

import torch

from forklift.native.build import load_native_library

PROFILER_NAME = "forklift::native_quant_matmul"
_DTYPE_FLAGS = {torch.bfloat16: 1, torch.float32: 0}


class QuantMatmulKernel:
    """The loaded kernel library; construct through `load()`."""

    def __init__(self, library: ctypes.CDLL) -> None:
        function = library.forklift_quant_matmul
        function.argtypes = [
            ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
            ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
            ctypes.c_int,
        ]  # fmt: skip
        function.restype = ctypes.c_int
        self._function = function
        self._library = library

    @property
    def tiles_available(self) -> bool:
        """Whether matmuls of 16 rows or more run on AMX tiles (built for and granted)."""
        return bool(self._library.forklift_quant_tiles_available())

    def wide_precise(self, form: str) -> bool:
        """Whether a precise weight of `form` ("int4" or "int8") takes each activation row
        as one wide row of codes (twelve bits for a q4 weight, the MLP's down projection;
        sixteen for a q8 one, the LM head) rather than as two int8 rows: both forms with
        the paired kernels (csrc/quant_matmul_avx512.h), q8 alone on AVX2
        (csrc/quant_matmul_avx2.h)."""
        bits = {"int4": 1, "int8": 2}
        if form not in bits:
            raise ValueError(f"form must be one of {sorted(bits)}, got {form!r}")
        bit = bits[form]
        return bool(self._library.forklift_quant_wide_precise() & bit)

    @classmethod
    def load(cls, arch: tuple[str, ...] | None = None) -> QuantMatmulKernel | None:
        library = load_native_library("quant_matmul", arch)
        return None if library is None else cls(library)

    def __call__(
        self,
        x: torch.Tensor,
        codes: torch.Tensor,
        scales: torch.Tensor,
        mins: torch.Tensor | None,
        out_features: int,
        precise: bool = False,
    ) -> torch.Tensor:
        if x.dtype not in _DTYPE_FLAGS:  # fp16 and others compute in fp32
            return self(x.float(), codes, scales, mins, out_features, precise).to(x.dtype)
        x = x.contiguous()
        rows, k = x.shape
        out = x.new_empty(rows, out_features)
        profiling = torch.autograd.profiler._is_profiler_enabled
        with torch.profiler.record_function(PROFILER_NAME) if profiling else nullcontext():
            failed = self._function(
                x.data_ptr(), rows, k, codes.data_ptr(), scales.data_ptr(),
                None if mins is None else mins.data_ptr(), out_features, int(precise),
                out.data_ptr(), _DTYPE_FLAGS[x.dtype], torch.get_num_threads(),
            )  # fmt: skip
        if failed:
            raise MemoryError("the quantized matmul could not allocate its scratch buffers")
        return out
