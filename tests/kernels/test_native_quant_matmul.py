"""The native block kernels (forklift/native/csrc/quant_matmul.h): for every instruction set
this machine runs (its own, AVX2, and plain C) and both block types, the product equals a
float reference that quantizes the activations as the kernel does, for odd shapes and 1-600
rows, in fp32 and bf16; the interleaved layout holds exactly the weights it was given."""

from __future__ import annotations

import ctypes
import subprocess

import pytest
import torch
from kernel_oracles import (
    activation_quantized,
    activation_quantized_wide,
    quant_matmul_reference,
)

from forklift.cpu import cpu_flags, native_arch_flags
from forklift.model.layers.block_weights import BlockInt4, BlockInt8
from forklift.model.layers.quantized import Int4Groups, int4_groups_from_dense
from forklift.native import build as native_build
from forklift.native.quant_matmul import QuantMatmulKernel

# The instruction sets to build for: the host's own (VNNI where it has it), AVX2, plain C.
TARGETS = {
    "native": None,
    "avx2": ("-march=x86-64-v3",),
    "scalar": ("-march=x86-64", "-mno-sse4.2"),
}


@pytest.fixture(scope="module", params=list(TARGETS))
def kernel(request) -> QuantMatmulKernel:
    if native_build.find_compiler() is None:
        pytest.skip("no C compiler on this machine")
    if request.param == "avx2" and not {"avx2", "fma", "f16c"} <= cpu_flags():
        pytest.skip("this CPU cannot run AVX2 code")
    loaded = QuantMatmulKernel.load(TARGETS[request.param])
    assert loaded is not None, "a C compiler is here, yet the kernel did not build or load"
    return loaded


@pytest.fixture(autouse=True)
def two_threads():
    """Two threads, whatever cores this machine has: the shapes below of three row groups or
    more then give each thread groups in pairs, the form the 512-bit and tile paths take."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _amx_int8_usable() -> bool:
    """The CPU shows AMX-INT8, the compiler targets it for this CPU and the kernel grants
    the tile state (arch_prctl may refuse it: an old kernel, some sandboxes)."""
    compiler = native_build.find_compiler()
    if "amx_int8" not in cpu_flags() or compiler is None:
        return False
    macros = subprocess.run(
        [compiler, *native_arch_flags(), "-dM", "-E", "-"], input="", capture_output=True,
        text=True, check=True,
    ).stdout  # fmt: skip
    arch_prctl, request_permission, tile_data = 158, 0x1023, 18
    granted = ctypes.CDLL(None).syscall(arch_prctl, request_permission, tile_data) == 0
    return "__AMX_INT8__" in macros and granted


def test_amx_cpus_multiply_on_tiles():
    """Where AMX-INT8 is usable this machine's own build multiplies 16 rows or more on tiles
    (so the tests of 16 rows and more below run that path); no other build ever does."""
    if native_build.find_compiler() is None:
        pytest.skip("no C compiler on this machine")
    native = QuantMatmulKernel.load(TARGETS["native"])
    assert native is not None
    assert native.tiles_available == _amx_int8_usable()
    for target in ("avx2", "scalar"):
        if target == "avx2" and not {"avx2", "fma", "f16c"} <= cpu_flags():
            continue
        assert not QuantMatmulKernel.load(TARGETS[target]).tiles_available


SHAPES = [(8, 32), (13, 64), (40, 32), (40, 64), (96, 96), (200, 576), (33, 1536)]


@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("form", ["int4", "int8"])
def test_block_matmul_equals_the_reference(kernel, n, k, form):
    torch.manual_seed(n * k)
    weight = torch.randn(n, k)
    blocks = (
        BlockInt4.from_dense(weight, kernel)
        if form == "int4"
        else BlockInt8.from_dense(weight, kernel)
    )
    exact = blocks.dequantize()
    assert ((exact - weight).norm() / weight.norm()).item() < (0.1 if form == "int4" else 0.01)
    for rows in (1, 2, 3, 4, 5, 8, 16, 17, 33):
        x = torch.randn(rows, k)
        x[0, :32] = 0.0  # an all-zero block: scale 0, no division by it
        want = quant_matmul_reference(x, exact)
        got = blocks.linear(x)
        assert got.dtype == torch.float32 and got.shape == (rows, n)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4 * want.abs().max().item())
        got_bf16 = blocks.linear(x.bfloat16())
        assert got_bf16.dtype == torch.bfloat16
        want_bf16 = quant_matmul_reference(x.bfloat16().float(), exact)
        torch.testing.assert_close(got_bf16.float(), want_bf16, rtol=1e-2, atol=1e-2)


def _precise_reference(kernel: QuantMatmulKernel, form: str, x: torch.Tensor) -> torch.Tensor:
    """The activations as a precise weight takes them: wide rows where the kernel has them
    (a q4 weight's of twelve-bit codes, a q8 weight's of sixteen), else two int8 rows, the
    quantized row and what its rounding left."""
    if kernel.wide_precise(form):
        return activation_quantized_wide(x, 2047 if form == "int4" else 32639)
    first = activation_quantized(x)
    return first + activation_quantized(x - first)


@pytest.mark.parametrize("form", ["int4", "int8"])
def test_precise_activations_equal_their_reference_and_beat_int8(kernel, form):
    """A precise weight (an LM head, a down projection) takes finer activations than int8:
    the product equals that reference and is far closer to the float product (twelve-bit
    codes: at least 10x; two int8 rows: at least 50x). A q8 weight's wide rows take every
    form here: dot products (1, 3), a tile of paired rows (8), a tile of 9-15 split rows (9,
    12) and tiles of sixteen (16, 40)."""
    torch.manual_seed(5)
    n, k = 42, 192  # six row groups, the last one partial: each thread's last has no partner
    weight = torch.randn(n, k)
    build = BlockInt4.from_dense if form == "int4" else BlockInt8.from_dense
    precise, plain = build(weight, kernel, precise=True), build(weight, kernel)
    exact = precise.dequantize()
    factor = 10 if form == "int4" and kernel.wide_precise(form) else 50
    for rows in (1, 3, 8, 9, 12, 16, 40):
        x = torch.randn(rows, k) * torch.linspace(0.1, 10, k)  # uneven blocks, as real ones
        want = (_precise_reference(kernel, form, x).double() @ exact.double().T).float()
        got = precise.linear(x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4 * want.abs().max().item())
        floats = x.double() @ exact.double().T
        error, plain_error = (got - floats).abs().max(), (plain.linear(x) - floats).abs().max()
        assert error < plain_error / factor


def test_wide_precise_names_its_form(kernel):
    """Which forms take wide rows is asked by form name; any other name is refused."""
    assert isinstance(kernel.wide_precise("int8"), bool)
    if kernel.wide_precise("int4"):  # the paired kernels widen both forms
        assert kernel.wide_precise("int8")
    with pytest.raises(ValueError, match="form"):
        kernel.wide_precise("q4")


def _each_row_alone(
    kernel: QuantMatmulKernel, form: str, precise: bool, n: int, k: int, rows: int, seed: int
) -> tuple[BlockInt4 | BlockInt8, torch.Tensor, torch.Tensor]:
    """Random blocks, `rows` activation rows of uneven blocks, and each row's product alone."""
    torch.manual_seed(seed)
    build = BlockInt4.from_dense if form == "int4" else BlockInt8.from_dense
    blocks = build(torch.randn(n, k), kernel, precise=precise)
    x = torch.randn(rows, k) * torch.linspace(0.1, 10, k)
    return blocks, x, torch.cat([blocks.linear(x[i : i + 1]) for i in range(rows)])


@pytest.mark.parametrize("form", ["int4", "int8"])
@pytest.mark.parametrize("precise", [False, True])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(kernel, form, precise):
    """Bit for bit, alone or among up to 40 rows: speculation verifies drafts as extra rows
    and promises the tokens of decoding without them. From 16 rows, where the CPU has AMX,
    sixteen rows at a time multiply on tiles, the rest as below 16."""
    blocks, x, alone = _each_row_alone(kernel, form, precise, n=72, k=320, rows=40, seed=11)
    for rows in range(2, 41):
        assert torch.equal(blocks.linear(x[:rows]), alone[:rows]), rows
    assert torch.equal(blocks.linear(x[24:40]), alone[24:40])


@pytest.mark.parametrize("form", ["int4", "int8"])
@pytest.mark.parametrize("precise", [False, True])
def test_prefill_sized_steps_equal_the_reference_and_each_row_alone(kernel, form, precise):
    """Prompt chunks run the same kernel: 1-600 rows (tiles of 16 with the pair's blocks
    unpacked once, a tail on dot products, past 512 rows a second slab) equal the float
    reference, and every row equals its product alone, bit for bit."""
    blocks, x, alone = _each_row_alone(kernel, form, precise, n=56, k=192, rows=600, seed=23)
    exact = blocks.dequantize()
    for rows in (1, 31, 32, 47, 100, 257, 600):
        got = blocks.linear(x[:rows])
        assert torch.equal(got, alone[:rows]), rows
        if precise:
            want = (_precise_reference(kernel, form, x[:rows]).double() @ exact.double().T).float()
        else:
            want = quant_matmul_reference(x[:rows], exact)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4 * want.abs().max().item())


@pytest.mark.parametrize("form", ["int4", "int8"])
@pytest.mark.parametrize("precise", [False, True])
def test_outputs_past_a_megabyte_equal_each_row_alone(kernel, form, precise):
    """From 1 MiB of output the tiles stream their sums to memory (quant_matmul.h) and each
    thread unpacks the next pair of groups during a pair's last tile: 520 rows of 528
    outputs (a second slab of 8 rows on dot products, a group left alone at the end of a
    thread's share) still equal each row's product alone, bit for bit, and 31 rows too."""
    blocks, x, alone = _each_row_alone(kernel, form, precise, n=528, k=96, rows=520, seed=29)
    assert 4 * 520 * 528 >= 2**20
    assert torch.equal(blocks.linear(x), alone)
    assert torch.equal(blocks.linear(x[:31]), alone[:31])


def test_int4_blocks_hold_the_groups_exactly(kernel):
    """GGUF-like groups (fp16-representable d and m) survive the interleaved layout bit for
    bit, rows past a multiple of eight included."""
    torch.manual_seed(1)
    n, k = 21, 128
    scales = torch.rand(n, k // 32).to(torch.float16).float()
    mins = -torch.rand(n, k // 32).to(torch.float16).float()
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    groups = Int4Groups(codes, scales, mins + 8 * scales)
    blocks = BlockInt4.from_groups(groups, kernel)
    assert torch.equal(blocks.dequantize(), groups.dequantize())
    assert blocks.nbytes == 3 * 8 * (k // 32) * (16 + 2 + 2)  # three row groups of eight


@pytest.mark.parametrize("form", ["int4", "int8"])
@pytest.mark.parametrize("k", [64, 576])  # the per-block form alone; sixteen blocks at a time
def test_a_block_too_small_for_its_scale_quantizes_to_zeros(kernel, form, k):
    """A block whose largest magnitude makes max / 127 a denormal (its reciprocal overflows)
    adds nothing: the product equals the reference with that block zeroed, finite, on every
    row count (q4's offset term would carry an overflowed sum into every output)."""
    torch.manual_seed(k)
    build = BlockInt4.from_dense if form == "int4" else BlockInt8.from_dense
    blocks = build(torch.randn(24, k), kernel)
    exact = blocks.dequantize()
    for rows in (1, 5, 40):
        x = torch.randn(rows, k)
        x[:, 32:64] = torch.linspace(-1e-38, 1e-38, 32)
        got = blocks.linear(x)
        zeroed = x.clone()
        zeroed[:, 32:64] = 0.0
        want = quant_matmul_reference(zeroed, exact)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4 * want.abs().max().item())


def test_fp16_activations_compute_in_fp32(kernel):
    torch.manual_seed(2)
    blocks = BlockInt8.from_dense(torch.randn(16, 64), kernel)
    x = torch.randn(3, 64)
    got = blocks.linear(x.half())
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), blocks.linear(x.half().float()), rtol=1e-3, atol=1e-3)


def test_bad_shapes_are_refused(kernel):
    blocks = BlockInt4.from_dense(torch.randn(8, 64), kernel)
    with pytest.raises(ValueError, match="expected input"):
        blocks.linear(torch.randn(2, 32))
    with pytest.raises(ValueError, match="divisible by 32"):
        BlockInt8.from_dense(torch.randn(8, 48), kernel)
    with pytest.raises(ValueError, match="divisible by 32"):
        int4_groups_from_dense(torch.randn(8, 48))


def test_each_target_builds_its_own_library():
    compiler = native_build.find_compiler()
    if compiler is None:
        pytest.skip("no C compiler on this machine")
    paths = {native_build.library_path("quant_matmul", compiler, arch) for arch in TARGETS.values()}
    assert len(paths) == len(TARGETS)
