"""Every native kernel compiles for the instruction sets a CPU may have beyond this machine's
(AVX-512 without VNNI, with VNNI, with AVX512-BF16 but no AMX as on AMD's Zen 4, and with
AMX and AVX512-BF16) and for plain x86-64 (the
C fallbacks of a CPU without AVX2): an edit that breaks one
kind's build fails here, not on the first machine of that kind, where the loader would
quietly fall back to the PyTorch kernels. The kinds this machine runs are built and run by
the other kernel tests; these are compiled only (unoptimised, which still inlines every
always-inline function and so checks each intrinsic against the target)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from forklift.native.build import COMPILE_FLAGS, NATIVE_SOURCE_DIR, find_compiler

TARGETS = {
    "x86-64": ("-march=x86-64",),
    "avx512": ("-march=skylake-avx512", "-mprefer-vector-width=512"),
    "avx512-vnni": ("-march=icelake-server", "-mprefer-vector-width=512"),
    "avx512-bf16": ("-march=cooperlake", "-mprefer-vector-width=512"),
    "zen4-tuned": (
        "-march=icelake-server",
        "-mavx512bf16",
        "-mtune=znver3",
        "-mprefer-vector-width=512",
    ),
    "sapphire-rapids": ("-march=sapphirerapids", "-mprefer-vector-width=512"),
}
KERNELS = sorted(path.stem for path in NATIVE_SOURCE_DIR.glob("*.c"))


def test_every_kernel_source_is_listed():
    assert {"decode_step", "decode_attention", "quant_matmul"} <= set(KERNELS)


@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("kernel", KERNELS)
def test_the_kernel_compiles_for_the_target(tmp_path: Path, kernel: str, target: str):
    compiler = find_compiler()
    if compiler is None:
        pytest.skip("no C compiler on this machine")
    flags = ["-O0", "-c", *(f for f in COMPILE_FLAGS if f not in ("-O3", "-shared"))]
    command = [compiler, *flags, *TARGETS[target], "-o", str(tmp_path / f"{kernel}.o"),
               str(NATIVE_SOURCE_DIR / f"{kernel}.c")]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    if done.returncode != 0 and "-march=" in done.stderr and "bad value" in done.stderr:
        pytest.skip(f"{compiler} does not know {TARGETS[target][0]}")
    assert done.returncode == 0, done.stderr
