"""Decode attention through the C kernel in native/csrc/decode_attention.c.

The kernel reads keys and values straight from the paged cache through the block table,
as the compiled in-place kernel does, but as one call into plain C: no guard checks and no
graph wrapper per layer, one fp32 widening per loaded row shared by a KV head's query heads,
and masked positions skipped. Same arguments and result as `DecodeKernel`.
"""

from __future__ import annotations

import ctypes
from contextlib import nullcontext

import torch

from forklift.native.build import load_native_library

_DTYPE_FLAGS = {torch.bfloat16: 1, torch.float32: 0}
PROFILER_NAME = "forklift::native_decode_attention"


class NativeDecodeAttention:
    """A loaded kernel library; construct through `load()`."""

    def __init__(self, library: ctypes.CDLL) -> None:
        function = library.forklift_decode_attention
        pointers, sizes = [ctypes.c_void_p] * 6, [ctypes.c_int64] * 7
        function.argtypes = [*pointers, *sizes, ctypes.c_float, ctypes.c_int, ctypes.c_int]
        function.restype = ctypes.c_int
        self._function = function

    @classmethod
    def load(cls) -> NativeDecodeAttention | None:
        library = load_native_library("decode_attention")
        return None if library is None else cls(library)

    @staticmethod
    def supports(q: torch.Tensor, key_cache: torch.Tensor) -> bool:
        """CPU tensors in bf16 or fp32 (queries in the cache's dtype), the cache contiguous."""
        return (
            key_cache.device.type == "cpu"
            and key_cache.dtype in _DTYPE_FLAGS
            and q.dtype == key_cache.dtype
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
        kv_heads, num_blocks, block_size, _ = key_cache.shape
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
                _DTYPE_FLAGS[q.dtype], torch.get_num_threads(),
            )  # fmt: skip
        if failed:
            raise MemoryError("decode attention could not allocate its scratch buffers")
        return out
