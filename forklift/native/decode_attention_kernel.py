"""Decode attention through the C kernel in native/csrc/decode_attention.c.

The kernel reads keys and values straight from the paged cache through the block table,
as the compiled in-place kernel does, but as one call into plain C: no guard checks and no
graph wrapper per layer, one fp32 widening per loaded row shared by a KV head's query heads,
and masked positions skipped. Same arguments and result as `DecodeKernel`; the cache in
bf16 or fp32 whatever the queries' dtype, or coded (int8 or fp8 rows with a scale each,
model/kv_cache_dtype.py), widened inside the kernel. The kernel reads rows as stored: its
caller rotates queries and outputs for a rotated cache.
"""

from __future__ import annotations

import ctypes
from contextlib import nullcontext

import torch

from forklift.native.build import load_native_library

_DTYPE_FLAGS = {torch.bfloat16: 1, torch.float32: 0}
# Coded caches (rows of one-byte codes with a scale each) and csrc/paged_attention.h's
# CACHE_* value of every cache dtype: fp32 0, bf16 1, int8 2, fp8 e4m3 3, fp8 e5m2 4.
CODED_CACHE_DTYPES = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)
CACHE_FORMATS = {**_DTYPE_FLAGS, **{dtype: 2 + i for i, dtype in enumerate(CODED_CACHE_DTYPES)}}
PROFILER_NAME = "forklift::native_decode_attention"


class NativeDecodeAttention:
    """A loaded kernel library; construct through `load()`."""

    def __init__(self, library: ctypes.CDLL) -> None:
        function = library.forklift_decode_attention
        pointers, sizes = [ctypes.c_void_p] * 6, [ctypes.c_int64] * 7
        flags = [ctypes.c_int] * 3  # cache format, bf16 queries, threads
        function.argtypes = [*pointers, *sizes, ctypes.c_float, *flags]
        function.restype = ctypes.c_int
        self._function = function

    @classmethod
    def load(cls) -> NativeDecodeAttention | None:
        library = load_native_library("decode_attention")
        return None if library is None else cls(library)

    @staticmethod
    def supports(q: torch.Tensor, key_cache: torch.Tensor) -> bool:
        """CPU tensors, queries in bf16 or fp32 and the cache in either (whatever the
        queries' dtype) or coded, the cache contiguous."""
        return (
            key_cache.device.type == "cpu"
            and q.dtype in _DTYPE_FLAGS
            and key_cache.dtype in CACHE_FORMATS
            and key_cache.is_contiguous()
        )

    def __call__(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        kv_blocks: torch.Tensor,
        bias: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        seqs, heads, head_dim = q.shape
        kv_heads, num_blocks, block_size = key_cache.shape[:3]
        if value_cache.dtype != key_cache.dtype or not value_cache.is_contiguous():
            raise ValueError("the value cache must match the key cache: dtype and layout")
        # The C side reads int64 block ids, float32 biases and packed rows (no-ops as built).
        q = q.contiguous()
        kv_blocks = kv_blocks.to(torch.int64).contiguous()
        bias = bias.to(torch.float32).contiguous()
        out = q.new_empty(seqs, heads * head_dim)
        # torch.profiler sees no operator in a C call: name one (only while profiling).
        profiling = torch.autograd.profiler._is_profiler_enabled
        with torch.profiler.record_function(PROFILER_NAME) if profiling else nullcontext():
            failed = self._function(
                q.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
                kv_blocks.data_ptr(), bias.data_ptr(), out.data_ptr(), seqs, heads, kv_heads,
                num_blocks, block_size, head_dim, kv_blocks.shape[1], scale,
                CACHE_FORMATS[key_cache.dtype], _DTYPE_FLAGS[q.dtype], torch.get_num_threads(),
            )  # fmt: skip
        if failed:
            raise MemoryError("decode attention could not allocate its scratch buffers")
        return out
