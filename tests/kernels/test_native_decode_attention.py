"""The native C decode kernel: it matches a per-sequence reference (both dtypes, the head
sizes it specialises and others, grouped queries, a non-prefix mask), it is built once and
cached per machine, and every way of not having it leaves PyTorch's kernels in charge."""

from __future__ import annotations

import logging
import os
import platform
import shutil
import subprocess

import pytest
import torch
from kernel_oracles import (
    ATTENTION_TARGETS,
    load_attention_target,
    paged_attention_reference,
    paged_tables,
)

from forklift.cpu import CPU_KIND_ENV, cpu_flags
from forklift.model.layers.decode_attention import DecodeAttention
from forklift.native import build as native_build
from forklift.native.decode_attention_kernel import NativeDecodeAttention


@pytest.fixture(scope="module")
def native() -> NativeDecodeAttention:
    if native_build.find_compiler() is None:
        pytest.skip("no C compiler on this machine")
    kernel = NativeDecodeAttention.load()
    assert kernel is not None, "a C compiler is here, yet the kernel did not build or load"
    return kernel


@pytest.fixture(scope="module", params=list(ATTENTION_TARGETS))
def target_kernel(request) -> NativeDecodeAttention:
    return load_attention_target(request.param)


def _case(dtype, seqs, kv_heads, group, head_dim, seed, window=None, cache_dtype=None):
    gen = torch.Generator().manual_seed(seed)
    block_size, num_blocks = 4, 128
    shape = (kv_heads, num_blocks, block_size, head_dim)
    key_cache = torch.randn(shape, generator=gen).to(cache_dtype or dtype)
    value_cache = torch.randn(shape, generator=gen).to(cache_dtype or dtype)
    lengths = torch.randint(1, 8 * block_size, (seqs,), generator=gen)
    blocks, bias, valid = paged_tables(gen, lengths, block_size, num_blocks, window)
    q = torch.randn(seqs, kv_heads * group, head_dim, generator=gen).to(dtype)
    return q, key_cache, value_cache, blocks, bias, valid


# Queries (and outputs) in the model's dtype, the cache in its own: fp32 queries over a bf16
# cache are the default on a CPU without fast bf16 (EngineConfig.resolve_kv_cache_dtype).
DTYPES = {
    "fp32": (torch.float32, torch.float32),
    "bf16": (torch.bfloat16, torch.bfloat16),
    "fp32-on-bf16-cache": (torch.float32, torch.bfloat16),
}


@pytest.mark.parametrize("dtypes", list(DTYPES))
@pytest.mark.parametrize(
    "seqs, kv_heads, group, head_dim",
    [
        (1, 3, 3, 64),
        (8, 3, 3, 64),
        (2, 1, 5, 64),  # query heads past one register pass (4 at 64)
        (3, 2, 2, 128),
        (2, 1, 3, 128),  # ... and at 128 (2 a pass)
        (1, 1, 3, 256),
        (5, 1, 4, 16),
        (2, 4, 1, 48),
    ],
)
def test_native_kernel_matches_the_reference(
    request, target_kernel, dtypes, seqs, kv_heads, group, head_dim
):
    dtype, cache_dtype = DTYPES[dtypes]
    q, key_cache, value_cache, blocks, bias, valid = _case(
        dtype, seqs, kv_heads, group, head_dim, seed=seqs * 31 + head_dim, cache_dtype=cache_dtype
    )
    scale = head_dim**-0.5
    got = target_kernel(q, key_cache, value_cache, blocks, bias, scale)
    # Over the rows as stored, widened to fp32.
    want = paged_attention_reference(q, key_cache, value_cache, blocks, valid, scale)
    assert got.dtype == dtype and got.shape == (seqs, kv_heads * group * head_dim)
    # The native build's tiles on a bf16 cache take bf16 dot products where the CPU has
    # them (AVX512_BF16): fp32 queries are rounded to bf16 there.
    bf16_dots = (
        request.node.callspec.params["target_kernel"] == "native"
        and cache_dtype == torch.bfloat16
        and "avx512_bf16" in cpu_flags()
        and head_dim in (64, 128, 256)
    )
    tol = 1e-5 if dtype == torch.float32 and not bf16_dots else 2e-2
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


def test_native_kernel_skips_masked_positions_anywhere(target_kernel):
    """A sliding window masks the start of the context, not only its padded end."""
    q, key_cache, value_cache, blocks, bias, valid = _case(torch.float32, 4, 2, 2, 64, 5, 6)
    assert (~valid[:, 0]).any(), "the case should mask some leading positions"
    got = target_kernel(q, key_cache, value_cache, blocks, bias, 0.125)
    want = paged_attention_reference(q, key_cache, value_cache, blocks, valid, 0.125)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_decode_attention_runs_the_native_kernel_when_given_one(native, monkeypatch):
    q, key_cache, value_cache, blocks, bias, valid = _case(torch.bfloat16, 3, 2, 2, 64, 9)
    kernel = DecodeAttention(torch.device("cpu"), native)
    calls = []
    monkeypatch.setattr(kernel, "_kernel", lambda *a: calls.append("compiled"))
    with torch.inference_mode():
        out = kernel(q, key_cache, value_cache, blocks, bias, 0.125)
    assert not calls, "the compiled kernel ran although the native one applies"
    want = paged_attention_reference(q, key_cache, value_cache, blocks, valid, 0.125)
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)
    # A dtype the native kernel lacks goes to PyTorch's kernels; fp32 queries over a bf16
    # cache stay native.
    assert not native.supports(q.half(), key_cache.half())
    assert native.supports(q.float(), key_cache)


def test_library_is_built_once_then_loaded_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    if native_build.find_compiler() is None:
        pytest.skip("no C compiler")
    builds = []
    real_build = native_build.build_library
    monkeypatch.setattr(
        native_build, "build_library", lambda *a: (builds.append(a), real_build(*a))
    )
    assert native_build.load_native_library("decode_attention") is not None
    assert native_build.load_native_library("decode_attention") is not None
    assert len(builds) == 1
    (built,) = (tmp_path / "forklift" / "native").glob("decode_attention-*.so")
    assert not list(built.parent.glob("*.partial")), "a partial build was left behind"


@pytest.mark.skipif(shutil.which("objdump") is None, reason="no objdump to read the build")
def test_the_avx2_kind_builds_its_own_library_without_avx512_registers(tmp_path, monkeypatch):
    """FORKLIFT_CPU_KIND=avx2 compiles for x86-64-v3: a library of its own in the cache, whose
    code touches no zmm (AVX-512) register, so it runs on an AVX2-only CPU."""
    if native_build.find_compiler() is None or platform.machine() != "x86_64":
        pytest.skip("needs a C compiler on x86-64")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv(CPU_KIND_ENV, "avx2")
    assert native_build.load_native_library("decode_attention") is not None
    monkeypatch.setenv(CPU_KIND_ENV, "native")
    assert native_build.load_native_library("decode_attention") is not None
    built = {}
    for kind in ("avx2", "native"):
        monkeypatch.setenv(CPU_KIND_ENV, kind)
        built[kind] = native_build.library_path("decode_attention", native_build.find_compiler())
    assert built["avx2"] != built["native"] and all(p.exists() for p in built.values())
    code = subprocess.run(["objdump", "-d", str(built["avx2"])], capture_output=True,
                          text=True, check=True).stdout  # fmt: skip
    assert "ymm" in code and "zmm" not in code


def test_no_compiler_or_switched_off_means_no_native_kernel(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv(native_build.DISABLE_ENV, "0")
    assert NativeDecodeAttention.load() is None
    monkeypatch.delenv(native_build.DISABLE_ENV)
    monkeypatch.setattr(native_build, "find_compiler", lambda: None)
    assert NativeDecodeAttention.load() is None
    assert not (tmp_path / "forklift").exists()


def test_a_failing_build_warns_and_falls_back(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    fake = tmp_path / "fake-cc"
    fake.write_text("#!/bin/sh\necho 'fake-cc: cannot compile' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setattr(native_build, "find_compiler", lambda: str(fake))
    with caplog.at_level(logging.WARNING, logger="forklift"):
        assert NativeDecodeAttention.load() is None
    assert "cannot compile" in caplog.text
    assert not list((tmp_path / "forklift" / "native").glob("*"))


def test_the_engine_decodes_through_the_native_kernel(native, default_llm_fp32):
    runner = default_llm_fp32.llm_engine.runner
    layer = runner.model.config.attention_layers[0]
    kernel = runner.model.layers[layer].decode_attention
    assert isinstance(kernel, DecodeAttention) and kernel.native is not None
    key_cache, _ = runner.layer_caches[layer]
    assert kernel.native.supports(key_cache, key_cache)


def test_the_decode_benchmark_can_build_an_engine_without_it(native, monkeypatch):
    from forklift.bench.decode import WEIGHT_FORMS, native_kernels_enabled

    monkeypatch.delenv(native_build.DISABLE_ENV, raising=False)
    assert not WEIGHT_FORMS["int4-torch-attention"].native_kernels
    with native_kernels_enabled(False):
        assert NativeDecodeAttention.load() is None
    assert native_build.DISABLE_ENV not in os.environ
    assert NativeDecodeAttention.load() is not None


def test_a_value_cache_unlike_the_key_cache_is_refused(native):
    q, key_cache, value_cache, blocks, bias, _ = _case(torch.float32, 2, 2, 2, 64, 4)
    with pytest.raises(ValueError, match="value cache"):
        native(q, key_cache, value_cache.bfloat16(), blocks, bias, 0.125)


def _long_case(lengths: list[int], block_size: int = 16, seed: int = 0):
    """bf16 rows of the given lengths (blocks in order, as the allocator hands them out)."""
    gen = torch.Generator().manual_seed(seed)
    kv_heads, group, head_dim = 2, 3, 64
    width = -(-max(lengths) // block_size) + 1
    num_blocks = len(lengths) * width + 1
    shape = (kv_heads, num_blocks, block_size, head_dim)
    key_cache = torch.randn(shape, generator=gen).bfloat16()
    # Values offset block by block, so that every chunk's share shows in the output.
    offsets = 0.25 * (torch.arange(num_blocks) % 5).float()
    value_cache = (torch.randn(shape, generator=gen) + offsets[None, :, None, None]).bfloat16()
    blocks = 1 + torch.arange(len(lengths) * width).view(len(lengths), width)
    pos = torch.arange(width * block_size)[None, :]
    valid = pos < torch.tensor(lengths)[:, None]
    bias = torch.where(valid, 0.0, float("-inf"))
    q = torch.randn(len(lengths), kv_heads * group, head_dim, generator=gen).bfloat16()
    return q, key_cache, value_cache, blocks, bias, valid


@pytest.mark.parametrize("block_size", [16, 4])
def test_long_contexts_split_into_chunks_match_the_reference(target_kernel, block_size):
    """Contexts past one chunk of positions (1024): each chunk's partial result merged (a
    block size of 4 leaves the table's width short of a whole tile)."""
    q, key_cache, value_cache, blocks, bias, valid = _long_case([2500, 700, 1030], block_size)
    got = target_kernel(q, key_cache, value_cache, blocks, bias, 0.125)
    want = paged_attention_reference(q, key_cache, value_cache, blocks, valid, 0.125)
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=2e-3)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_fp32_caches_past_one_value_chunk_match_the_reference(target_kernel, head_dim):
    """An fp32 cache's values are summed in registers over chunks of 64 live positions:
    contexts of one position, exactly one chunk, one past it and several chunks (some
    masked at the start by a window) match the reference, and a query vector's result is
    the same bits with or without the vectors beside it."""
    gen = torch.Generator().manual_seed(head_dim)
    kv_heads, group, block_size, num_blocks = 2, 3, 4, 512
    shape = (kv_heads, num_blocks, block_size, head_dim)
    key_cache = torch.randn(shape, generator=gen)
    value_cache = torch.randn(shape, generator=gen)
    lengths = torch.tensor([1, 64, 65, 300])
    blocks, bias, valid = paged_tables(gen, lengths, block_size, num_blocks, 150)
    q = torch.randn(len(lengths), kv_heads * group, head_dim, generator=gen)
    scale = head_dim**-0.5
    together = target_kernel(q, key_cache, value_cache, blocks, bias, scale)
    want = paged_attention_reference(q, key_cache, value_cache, blocks, valid, scale)
    torch.testing.assert_close(together, want, rtol=1e-5, atol=1e-5)
    alone = target_kernel(q[:, :1].contiguous(), key_cache[:1].contiguous(),
                          value_cache[:1].contiguous(), blocks, bias, scale)  # fmt: skip
    assert torch.equal(alone, together[:, :head_dim])


def test_a_rows_result_does_not_depend_on_how_far_other_tables_reach(target_kernel):
    """A short row alone (one chunk, written directly) and beside a long one (its table
    padded to three chunks, merged): the same bits."""
    q, key_cache, value_cache, blocks, bias, _ = _long_case([300, 2500])
    beside = target_kernel(q, key_cache, value_cache, blocks, bias, 0.125)[0]
    own_width = -(-300 // 16) + 1
    alone = target_kernel(
        q[:1], key_cache, value_cache, blocks[:1, :own_width].contiguous(),
        bias[:1, : own_width * 16].contiguous(), 0.125,
    )[0]  # fmt: skip
    assert torch.equal(alone, beside)


@pytest.mark.parametrize("block_size", [16, 4])
@pytest.mark.parametrize("window", [None, 37])
def test_a_query_vectors_result_does_not_depend_on_the_vectors_beside_it(
    target_kernel, window, block_size
):
    """48 query heads on one KV head (three blocks of sixteen vectors: where tiles build,
    the keys are packed once and multiplied by each block) against each head alone (the
    keys as they lie), over contexts that start and end mid-tile, with and without a
    sliding window, in blocks of 16 (a tile's keys consecutive) and of 4 (gathered): the
    same bits."""
    gen = torch.Generator().manual_seed(11)
    num_blocks, head_dim, group = 2048 // block_size, 64, 48
    shape = (1, num_blocks, block_size, head_dim)
    key_cache = torch.randn(shape, generator=gen).bfloat16()
    value_cache = torch.randn(shape, generator=gen).bfloat16()
    lengths = torch.tensor([5, 40, 181, 300])
    blocks, bias, _ = paged_tables(gen, lengths, block_size, num_blocks, window)
    q = torch.randn(len(lengths), group, head_dim, generator=gen).bfloat16()
    together = target_kernel(q, key_cache, value_cache, blocks, bias, 0.125)
    for head in range(0, group, 7):
        alone = target_kernel(
            q[:, head : head + 1].contiguous(), key_cache, value_cache, blocks, bias, 0.125
        )
        assert torch.equal(alone, together[:, head * head_dim : (head + 1) * head_dim])
