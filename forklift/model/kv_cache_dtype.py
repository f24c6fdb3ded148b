"""How the paged KV cache stores a row (one token's K or V for one KV head).

`auto` keeps rows in the model's dtype (the engine settles it to `bfloat16` on a CPU when
no dtype was asked for: EngineConfig.resolve_kv_cache_dtype); `bfloat16` and `float32` keep
them in that dtype whatever the model computes in. `int8` keeps each row as head_dim int8 codes
followed by its float32 scale (the row's largest magnitude over 127), head_dim + 4 bytes
instead of 2 * head_dim: about twice the tokens in the same memory, and half the bytes a
decode step reads. The layout costs what llama.cpp's q8_0 costs (a 4-byte scale per 64
values is its 2-byte scale per 32), with a scale per token and head as vLLM's dynamic int8
cache has, so a row depends on its own values only: a quantized cache keeps a request's
answer independent of what shares its steps.

Where head_dim is a power of two, a row is rotated by the normalised Hadamard transform
before it is quantized (as llama.cpp rotates a quantized cache): the rotation spreads a
few large channels over all of them, so one scale per row loses far less (Gemma 3 270M:
mean KL against the bf16 cache 0.0100 without, 0.0025 with;
benchmarks/kv-cache-int8-quality.md).
The transform is orthonormal and its own inverse, so attention never un-rotates a row:
queries are rotated instead (a score is the same dot product), and the weighted sum of
rotated values is rotated back once per output row.

`fp8` (= `fp8_e4m3`) and `fp8_e5m2`, vLLM's fp8 names, keep one fp8 code a value in the same
layout (the row scaled so its largest magnitude is the format's largest), with the same
rotation; they lose more than int8 (the same report).

The cache tensor of a coded cache is int8 or torch's float8 dtype with a last dimension of
head_dim + 4; every place that moves whole blocks (copy-on-write forks, zeroing) needs no
change. The native step rotates, quantizes as it writes and widens inside its attention
kernels (csrc/paged_attention.h's coded formats); the PyTorch layers write through
`quantize_rows` and read through `dequantize_rows`, which rotates back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from forklift.config import PLAIN_KV_CACHE_DTYPES, validate_kv_cache_dtype

# The float32 scale's bytes after a row's codes.
SCALE_BYTES = 4
# Each coded cache's tensor dtype and its codes' largest magnitude (a row's scale is its
# largest value over it). "fp8" is e4m3, as in vLLM.
CODE_DTYPES = {
    "int8": torch.int8,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
# Caches of plain values in a dtype of their own (the model may compute in another: rows
# are converted as they are written and widened to fp32 as attention reads them).
PLAIN_DTYPES = {name: getattr(torch, name) for name in PLAIN_KV_CACHE_DTYPES}
CODE_MAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
_NAMES = {torch.int8: "int8", torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}


@dataclass(frozen=True)
class KVCacheFormat:
    """A resolved cache dtype: what the cache tensor holds per row."""

    name: str  # "int8", "fp8_e4m3", "fp8_e5m2", "bfloat16", "float32" ("auto": the model's)
    storage: torch.dtype  # the cache tensor's dtype

    @property
    def quantized(self) -> bool:
        return self.storage in CODE_MAX

    def row_elements(self, head_dim: int) -> int:
        """The cache tensor's last dimension."""
        return head_dim + SCALE_BYTES if self.quantized else head_dim

    def row_bytes(self, head_dim: int) -> int:
        return self.row_elements(head_dim) * torch.empty((), dtype=self.storage).element_size()


def kv_cache_format(kv_cache_dtype: str, model_dtype: torch.dtype) -> KVCacheFormat:
    validate_kv_cache_dtype(kv_cache_dtype)
    if kv_cache_dtype in CODE_DTYPES:
        storage = CODE_DTYPES[kv_cache_dtype]
        return KVCacheFormat(_NAMES[storage], storage)
    if kv_cache_dtype in PLAIN_DTYPES:
        return KVCacheFormat(kv_cache_dtype, PLAIN_DTYPES[kv_cache_dtype])
    return KVCacheFormat(str(model_dtype).removeprefix("torch."), model_dtype)


def is_quantized_cache(cache: torch.Tensor) -> bool:
    return cache.dtype in CODE_MAX


def rotation_applies(head_dim: int) -> bool:
    """A coded cache rotates rows of a power-of-two size (csrc/paged_attention.h agrees)."""
    return head_dim >= 2 and head_dim & (head_dim - 1) == 0


def hadamard_rotate(rows: torch.Tensor) -> torch.Tensor:
    """rows @ H / sqrt(D) along the last dimension (Sylvester's H: butterflies of a + b and
    a - b at distances 1, 2, 4, ...): orthonormal and its own inverse."""
    size = rows.shape[-1]
    x = rows.float().reshape(-1, size)
    span = 1
    while span < size:
        pairs = x.view(x.shape[0], size // (2 * span), 2, span)
        x = torch.stack([pairs[:, :, 0] + pairs[:, :, 1], pairs[:, :, 0] - pairs[:, :, 1]], 2)
        x = x.view(-1, size)
        span *= 2
    return (x * size**-0.5).view(rows.shape)


def quantize_rows(rows: torch.Tensor, storage: torch.dtype = torch.int8) -> torch.Tensor:
    """[..., D] floats -> [..., D + 4] rows of `storage`: the row rotated (where
    `rotation_applies`), then codes of x * top / max|x| (int8: rounded, ties to even; fp8:
    converted, to nearest) and the float32 scale max|x| / top as bytes, top the codes'
    largest magnitude (csrc/paged_attention.h's quantize_cache_row)."""
    x = rows.float()
    if rotation_applies(x.shape[-1]):
        x = hadamard_rotate(x)
    top = CODE_MAX[storage]
    largest = x.abs().amax(dim=-1, keepdim=True)
    scale = largest / top
    inverse = torch.where(largest > 0, top / largest, torch.zeros_like(largest))
    scaled = x * inverse
    codes = (torch.round(scaled) if storage == torch.int8 else scaled).to(storage)
    packed = torch.cat([codes.view(torch.uint8), scale.view(torch.uint8)], dim=-1)
    return packed.view(storage)


def stored_rows(packed: torch.Tensor) -> torch.Tensor:
    """[..., D + 4] coded rows -> [..., D] float32 code * scale: the rows as the kernels read
    them (still rotated)."""
    head_dim = packed.shape[-1] - SCALE_BYTES
    codes = packed[..., :head_dim]
    scale = packed[..., head_dim:].contiguous().view(torch.float32)
    return codes.float() * scale


def dequantize_rows(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., D + 4] coded rows -> [..., D] values in `dtype`, rotated back."""
    rows = stored_rows(packed)
    if rotation_applies(rows.shape[-1]):
        rows = hadamard_rotate(rows)
    return rows.to(dtype)
