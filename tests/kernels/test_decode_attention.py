"""Decode attention over the paged cache: in place (compiled) and gathered agree with a
per-sequence reference; a compile failure falls back to the gathered kernel."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from forklift.model.layers.decode_attention import (
    DecodeAttention,
    gathered_decode_attention,
)


def _case(dtype: torch.dtype, seqs: int, kv_heads: int, group: int, seed: int):
    torch.manual_seed(seed)
    head_dim, block_size, num_blocks = 16, 4, 40
    key_cache = torch.randn(kv_heads, num_blocks, block_size, head_dim, dtype=dtype)
    value_cache = torch.randn(kv_heads, num_blocks, block_size, head_dim, dtype=dtype)
    lengths = torch.randint(1, 6 * block_size, (seqs,))
    width = -(-int(lengths.max()) // block_size) + 1  # one padding block at least
    # Each sequence owns distinct blocks in a shuffled order; padding reads block 0.
    order = torch.randperm(num_blocks - 1)[: seqs * width].view(seqs, width) + 1
    used = torch.arange(width)[None, :] < (-(-lengths // block_size))[:, None]
    blocks = torch.where(used, order, 0)
    valid = torch.arange(width * block_size)[None, :] < lengths[:, None]
    bias = torch.where(valid, 0.0, float("-inf"))
    q = torch.randn(seqs, kv_heads * group, head_dim, dtype=dtype)
    return q, key_cache, value_cache, blocks, bias, lengths


def _reference(q, key_cache, value_cache, blocks, lengths, scale):
    """One sequence at a time: its tokens in order, SDPA over exactly its context."""
    outs = []
    kv_heads, _, _, head_dim = key_cache.shape
    for s in range(q.shape[0]):
        n = int(lengths[s])
        k = key_cache[:, blocks[s]].reshape(kv_heads, -1, head_dim)[:, :n].float()
        v = value_cache[:, blocks[s]].reshape(kv_heads, -1, head_dim)[:, :n].float()
        out = F.scaled_dot_product_attention(
            q[s].float()[:, None], k, v, scale=scale, enable_gqa=True
        )  # [H, 1, D]
        outs.append(out.reshape(-1))
    return torch.stack(outs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seqs, kv_heads, group", [(1, 2, 2), (2, 2, 2), (5, 3, 3), (3, 1, 4)])
def test_in_place_and_gathered_match_the_reference(dtype, seqs, kv_heads, group):
    q, key_cache, value_cache, blocks, bias, lengths = _case(dtype, seqs, kv_heads, group, 7)
    scale = 0.25
    want = _reference(q, key_cache, value_cache, blocks, lengths, scale)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    with torch.inference_mode():
        gathered = gathered_decode_attention(q, key_cache, value_cache, blocks, bias, scale)
        kernel = DecodeAttention(torch.device("cpu"))
        in_place = kernel(q, key_cache, value_cache, blocks, bias, scale)
    assert kernel.in_place, "the compiled in-place kernel fell back"
    torch.testing.assert_close(gathered.float(), want, rtol=tol, atol=tol)
    torch.testing.assert_close(in_place.float(), want, rtol=tol, atol=tol)
    assert in_place.dtype == dtype


def test_a_compile_failure_falls_back_to_the_gathered_kernel(caplog):
    q, key_cache, value_cache, blocks, bias, _ = _case(torch.float32, 2, 2, 2, 3)
    kernel = DecodeAttention(torch.device("cpu"))

    def broken(*args):
        raise RuntimeError("no C++ compiler")

    kernel._kernel = broken
    with caplog.at_level(logging.WARNING, logger="forklift"), torch.inference_mode():
        out = kernel(q, key_cache, value_cache, blocks, bias, 0.5)
        again = kernel(q, key_cache, value_cache, blocks, bias, 0.5)
    assert not kernel.in_place and "gathering blocks instead" in caplog.text
    want = gathered_decode_attention(q, key_cache, value_cache, blocks, bias, 0.5)
    assert torch.equal(out, want) and torch.equal(again, want)
    assert caplog.text.count("failed to compile") == 1
