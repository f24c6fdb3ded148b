"""References the kernel tests and the tests built on them share: the quantized matmul and
paged attention in PyTorch, each instruction set's build of the attention kernel, random
paged block tables, and the rule by which two decode paths' outputs count as the same."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from forklift.cpu import cpu_flags
from forklift.native import build as native_build
from forklift.native.decode_attention_kernel import NativeDecodeAttention

# Each instruction set's form of the attention kernel that this CPU runs: the tiled one with
# bf16 dot products, the tiled one widening keys (AVX-512 without AVX512_BF16) and the
# per-position one.
ATTENTION_TARGETS = {
    "native": (None, set()),
    "avx512-no-bf16": (("-march=skylake-avx512",), {"avx512f", "avx512bw", "avx512vl"}),
    "avx2": (("-march=x86-64-v3",), {"avx2", "fma", "f16c"}),
}


def activation_quantized(x: torch.Tensor) -> torch.Tensor:
    """x as the block kernels see it: int8 codes per 32 values with scale max|x| / 127."""
    rows, k = x.shape
    blocks = x.float().view(rows, k // 32, 32)
    scale = blocks.abs().amax(dim=-1, keepdim=True) / 127
    inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    return (torch.round(blocks * inverse) * scale).view(rows, k)


def activation_quantized_wide(x: torch.Tensor, code_max: int = 2047) -> torch.Tensor:
    """x as a precise weight's wide rows hold it: integer codes per 32 values with scale
    max|x| / code_max (a q4 weight's twelve bits, 2047; a q8 weight's sixteen, 32639)."""
    rows, k = x.shape
    blocks = x.float().view(rows, k // 32, 32)
    scale = blocks.abs().amax(dim=-1, keepdim=True) / code_max
    inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    return (torch.round(blocks * inverse) * scale).view(rows, k)


def quant_matmul_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The block matmul in float64 on the quantized activations."""
    return (activation_quantized(x).double() @ weight.double().T).float()


def load_attention_target(name: str) -> NativeDecodeAttention:
    """ATTENTION_TARGETS[name]'s build of the kernel; skips where this machine cannot build
    or run it."""
    arch, needs = ATTENTION_TARGETS[name]
    if native_build.find_compiler() is None:
        pytest.skip("no C compiler on this machine")
    if not needs <= cpu_flags():
        pytest.skip(f"this CPU cannot run the {name} build")
    library = native_build.load_native_library("decode_attention", arch)
    assert library is not None, "a C compiler is here, yet the kernel did not build or load"
    return NativeDecodeAttention(library)


def paged_tables(gen, lengths, block_size, num_blocks, window=None):
    """Block tables for sequences of `lengths` over blocks 1 .. num_blocks - 1 in random
    order (one spare column of block 0), and each position's bias and validity: a prefix of
    `lengths`, or its last `window` positions."""
    seqs = lengths.shape[0]
    width = -(-int(lengths.max()) // block_size) + 1
    order = torch.randperm(num_blocks - 1, generator=gen)[: seqs * width].view(seqs, width) + 1
    used = torch.arange(width)[None, :] < (-(-lengths // block_size))[:, None]
    blocks = torch.where(used, order, 0)
    pos = torch.arange(width * block_size)[None, :]
    valid = pos < lengths[:, None]
    if window is not None:
        valid &= pos > lengths[:, None] - 1 - window
    return blocks, torch.where(valid, 0.0, float("-inf")), valid


def paged_attention_reference(q, key_cache, value_cache, blocks, valid, scale):
    """Each sequence's attention over its valid cached positions, in fp32."""
    outs = []
    kv_heads, _, _, head_dim = key_cache.shape
    for s in range(q.shape[0]):
        k = key_cache[:, blocks[s]].reshape(kv_heads, -1, head_dim)[:, valid[s]].float()
        v = value_cache[:, blocks[s]].reshape(kv_heads, -1, head_dim)[:, valid[s]].float()
        out = F.scaled_dot_product_attention(
            q[s].float()[:, None], k, v, scale=scale, enable_gqa=True
        )
        outs.append(out.reshape(-1))
    return torch.stack(outs)


def step_deviations(got, want) -> list[float]:
    """Two runs' completions (with logprobs): the same tokens, and each chosen token's
    |logprob difference|, sorted."""
    deviations = []
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids
        for token, step_a, step_b in zip(a.token_ids, a.logprobs, b.logprobs, strict=True):
            deviations.append(abs(step_a[token].logprob - step_b[token].logprob))
    return sorted(deviations)


def assert_same_steps(got, want) -> None:
    """Same tokens; the chosen tokens' logprobs equal to rounding at most steps. A value
    that lands within rounding error of an int8 step of the activation quantization can
    round either way in the two paths (about one value in 10^5): that step, and the later
    ones that attend to its K/V, then differ by a few hundredths."""
    deviations = step_deviations(got, want)
    assert deviations[-1] < 0.1, deviations[-5:]
    assert deviations[len(deviations) * 3 // 4] < 1e-4, deviations
