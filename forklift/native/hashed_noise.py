"""The sampler's seeded noise through the C kernel in native/csrc/hashed_noise.c: the same
values as `sampling.sampler.hashed_uniform`'s PyTorch expression, bit for bit, in one pass
(a [64, 49152] draw: 44-48 ms as PyTorch operators on a 2-core CPU, 1.3-2.5 ms here)."""

from __future__ import annotations

import ctypes
import functools

import torch

from forklift.native.build import load_native_library


class NativeHashedUniform:
    """A loaded kernel library; construct through `load()`."""

    def __init__(self, library: ctypes.CDLL) -> None:
        function = library.forklift_hashed_uniform
        function.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                             ctypes.c_void_p, ctypes.c_int]  # fmt: skip
        function.restype = None
        self._function = function

    @classmethod
    def load(cls, arch: tuple[str, ...] | None = None) -> NativeHashedUniform | None:
        library = load_native_library("hashed_noise", arch)
        return None if library is None else cls(library)

    def __call__(self, seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
        seeds = seeds.to(torch.int64).contiguous()
        steps = steps.to(torch.int64).contiguous()
        out = torch.empty(seeds.shape[0], vocab, dtype=torch.float32)
        self._function(seeds.data_ptr(), steps.data_ptr(), seeds.shape[0], vocab,
                       out.data_ptr(), torch.get_num_threads())  # fmt: skip
        return out


@functools.cache
def native_hashed_uniform() -> NativeHashedUniform | None:
    """The kernel for this CPU, built once per process (None where none builds)."""
    return NativeHashedUniform.load()
