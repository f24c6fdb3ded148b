"""Decode attention (one query per sequence) over the paged KV cache.

Two implementations of the same arithmetic:
- `gathered_decode_attention` copies each sequence's blocks out of the cache (one
  `index_select` of whole blocks) and runs two batched matmuls. Any device.
- `in_place_decode_attention` writes the same arithmetic as indexing, broadcasts and
  reductions, which torch.compile on a CPU lowers to C++ loops that load K and V straight
  from the cache through the block table: no copy of the context.

On a CPU `DecodeAttention` runs the native C kernel (native/decode_attention_kernel.py)
where it builds; these two are its fallback and every other device's kernel. Without the
native kernel it picks the in-place kernel on a CPU for steps of several sequences and the
gathered one for a single sequence, where the compiled call's overhead outweighs the copy
(measured in `forklift bench decode`, int4 weights at 564 tokens of context on a 2-core
AVX512-BF16 CPU: a whole step takes 20.3 ms in place vs 18.7 ms gathered at one sequence,
42.7 vs 62.0 ms at 8, 101 vs 104 ms at 32). It falls back to the gathered kernel for good,
once and with a warning, if compiling fails (say, no C++ compiler on the machine).

Shapes: q [S, H, D]; caches [Hkv, num_blocks, block_size, D]; kv_blocks [S, nb]; bias
[S, nb * block_size] float32 (0 where a query attends, -inf elsewhere); the result is
[S, H * D]. Query head h reads KV head h // (H / Hkv).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch

from forklift.model.kv_cache_dtype import (
    dequantize_rows,
    hadamard_rotate,
    is_quantized_cache,
    rotation_applies,
)
from forklift.native.decode_attention_kernel import NativeDecodeAttention

logger = logging.getLogger("forklift")

DecodeKernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor
]


def gathered_decode_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    kv_blocks: torch.Tensor,
    bias: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    seqs, heads, head_dim = q.shape
    kv_heads = key_cache.shape[0]
    k = read_blocks(key_cache, kv_blocks, q.dtype)  # [Hkv, S, L, D]
    v = read_blocks(value_cache, kv_blocks, q.dtype)
    context = k.shape[2]
    # Each KV head's queries of one sequence are the rows of one small matmul.
    rows = q.view(seqs, kv_heads, heads // kv_heads, head_dim).transpose(0, 1)  # [Hkv, S, G, D]
    scores = torch.matmul(rows, k.transpose(2, 3)).float()  # [Hkv, S, G, L]
    probs = torch.softmax(scores.mul_(scale).add_(bias.view(1, seqs, 1, context)), dim=-1)
    out = torch.matmul(probs.to(v.dtype), v)  # [Hkv, S, G, D]
    return out.transpose(0, 1).reshape(seqs, heads * head_dim)


def in_place_decode_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    kv_blocks: torch.Tensor,
    bias: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Eagerly this materialises large broadcasts; it is meant to run compiled."""
    seqs, heads, head_dim = q.shape
    kv_heads, _, block_size, _ = key_cache.shape
    blocks = kv_blocks.shape[1]
    group = heads // kv_heads
    k = key_cache[:, kv_blocks]  # [Hkv, S, nb, bs, D]: indirect loads once compiled
    v = value_cache[:, kv_blocks]
    rows = q.view(seqs, kv_heads, group, head_dim).transpose(0, 1).float()  # [Hkv, S, G, D]
    scores = (rows[:, :, :, None, None, :] * k[:, :, None].float()).sum(-1)  # [Hkv,S,G,nb,bs]
    scores = scores.reshape(kv_heads, seqs, group, blocks * block_size) * scale
    probs = torch.softmax(scores + bias.view(1, seqs, 1, -1), dim=-1)
    probs = probs.view(kv_heads, seqs, group, blocks, block_size, 1)
    out = (probs * v[:, :, None].float()).sum(dim=(3, 4))  # [Hkv, S, G, D]
    return out.transpose(0, 1).reshape(seqs, heads * head_dim).to(q.dtype)


def read_blocks(cache: torch.Tensor, blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """cache [kv_heads, num_blocks, block_size, row] -> [kv_heads, S, blocks x block_size,
    head_dim] for a [S, blocks] table: each (head, sequence) context is contiguous, in
    `dtype` (an int8 cache's rows widened)."""
    kv_heads, num_blocks, block_size, row = cache.shape
    rows = cache.view(kv_heads, num_blocks, block_size * row).index_select(1, blocks.reshape(-1))
    rows = rows.view(kv_heads, blocks.shape[0], -1, row)
    return dequantize_rows(rows, dtype) if is_quantized_cache(cache) else rows.to(dtype)


@functools.cache
def _compiled_in_place() -> DecodeKernel:
    # One wrapper per process: dynamo keeps its compiled graphs on it (dynamic shapes: one
    # graph serves every batch and context size).
    return torch.compile(in_place_decode_attention, dynamic=True)


# Fewest sequences a step needs for the in-place kernel (see the module docstring).
IN_PLACE_MIN_SEQS = 2


class DecodeAttention:
    """The decode kernel of one model. On a CPU: the native C kernel where it builds (every
    batch size), else in place (compiled) for several sequences; gathered elsewhere."""

    def __init__(self, device: torch.device, native: NativeDecodeAttention | None = None) -> None:
        self.native = native
        self.in_place = device.type == "cpu"
        # Where the native kernel serves, dynamo is never imported (about 2 s at start-up).
        self._kernel: DecodeKernel | None = None
        self._no_duck_sizing: Any = None

    def _in_place_kernel(self) -> tuple[DecodeKernel, Any]:
        if self._kernel is None:
            self._kernel = _compiled_in_place()  # a wrapper: nothing compiles until called
            # Built once: a fresh config patch per call costs more than the kernel.
            self._no_duck_sizing = torch.fx.experimental._config.patch(use_duck_shape=False)
        return self._kernel, self._no_duck_sizing

    def __call__(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        kv_blocks: torch.Tensor,
        bias: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        native = self.native
        if native is not None and native.supports(q, key_cache):
            seqs, heads, head_dim = q.shape
            if not (is_quantized_cache(key_cache) and rotation_applies(head_dim)):
                return native(q, key_cache, value_cache, kv_blocks, bias, scale)
            # The kernel reads the stored rows, rotated: so are the queries, and the attended
            # values are rotated back (model/kv_cache_dtype.py).
            rotated_q = hadamard_rotate(q).to(q.dtype)
            out = native(rotated_q, key_cache, value_cache, kv_blocks, bias, scale)
            return hadamard_rotate(out.view(seqs, heads, head_dim)).to(q.dtype).view(seqs, -1)
        quantized = is_quantized_cache(key_cache)  # the in-place kernel reads raw rows
        if not self.in_place or q.shape[0] < IN_PLACE_MIN_SEQS or quantized:
            return gathered_decode_attention(q, key_cache, value_cache, kv_blocks, bias, scale)
        try:
            kernel, no_duck_sizing = self._in_place_kernel()
            # Without duck sizing, sizes that happen to be equal in one call (batch size and
            # KV heads, say) are not assumed equal forever, which would recompile later.
            with no_duck_sizing:
                return kernel(q, key_cache, value_cache, kv_blocks, bias, scale)
        except Exception as exc:  # compiling can fail in many ways; the math cannot
            logger.warning(
                "in-place decode attention failed to compile (%s); gathering blocks instead",
                exc,
            )
            self.in_place = False
            return gathered_decode_attention(q, key_cache, value_cache, kv_blocks, bias, scale)
