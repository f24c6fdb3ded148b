"""The sampler's last stage through the C kernel in native/csrc/seeded_sample.c: per row the
token (greedy, or the Gumbel-max draw with the seeded noise) and, where asked, its logprob
and rank, in one pass over the logits instead of a dozen PyTorch operators."""

from __future__ import annotations

import ctypes
import functools
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from forklift.native.build import load_native_library

PROFILER_NAME = "forklift::native_seeded_sample"


@dataclass
class SampledRows:
    token_ids: torch.Tensor  # [N] int64
    # Under log_softmax(logits / temperature) (the logits themselves for a greedy row);
    # None where not asked.
    logprobs: torch.Tensor | None  # [N] float32
    ranks: torch.Tensor | None  # [N] int64: 1 + how many tokens score higher


class NativeSeededSampler:
    """A loaded kernel library; construct through `load()`."""

    def __init__(self, library: ctypes.CDLL) -> None:
        function = library.forklift_seeded_sample
        function.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                             ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                             ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                             ctypes.c_int]  # fmt: skip
        function.restype = None
        self._function = function

    @classmethod
    def load(cls, arch: tuple[str, ...] | None = None) -> NativeSeededSampler | None:
        library = load_native_library("seeded_sample", arch)
        return None if library is None else cls(library)

    def __call__(
        self,
        logits: torch.Tensor,
        temperature: torch.Tensor,
        seeds: torch.Tensor,
        steps: torch.Tensor,
        with_logprobs: bool,
    ) -> SampledRows:
        """logits [N, vocab]; temperature [N], 0 for a greedy row; seeds and steps [N] as
        `hashed_uniform` takes them."""
        logits = logits.to(torch.float32).contiguous()
        temperature = temperature.to(torch.float32).contiguous()
        seeds = seeds.to(torch.int64).contiguous()
        steps = steps.to(torch.int64).contiguous()
        rows, vocab = logits.shape
        tokens = torch.empty(rows, dtype=torch.int64)
        logprobs = torch.empty(rows, dtype=torch.float32) if with_logprobs else None
        ranks = torch.empty(rows, dtype=torch.int64) if with_logprobs else None
        # torch.profiler sees no operator in a C call: name one (only while profiling).
        profiling = torch.autograd.profiler._is_profiler_enabled
        with torch.profiler.record_function(PROFILER_NAME) if profiling else nullcontext():
            self._function(
                logits.data_ptr(), rows, vocab, temperature.data_ptr(), seeds.data_ptr(),
                steps.data_ptr(), tokens.data_ptr(),
                0 if logprobs is None else logprobs.data_ptr(),
                0 if ranks is None else ranks.data_ptr(), torch.get_num_threads(),
            )  # fmt: skip
        return SampledRows(tokens, logprobs, ranks)


@functools.cache
def native_seeded_sampler() -> NativeSeededSampler | None:
    """The kernel for this CPU, built once per process (None where none builds)."""
    return NativeSeededSampler.load()
