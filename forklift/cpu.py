"""What this CPU can do, as the engine sees it: its feature flags, whether bf16 is fast, and
the flags native kernels are compiled with.

`FORKLIFT_CPU_KIND=avx2` makes a newer x86-64 CPU present itself as an AVX2-only one (no
AVX-512, AMX or AVX-VNNI): dtype "auto" picks float32, bf16 weights stay unpacked and native
kernels are built for x86-64-v3. Together with torch's own caps (`ATEN_CPU_CAPABILITY=avx2`,
`ONEDNN_MAX_CPU_ISA=AVX2`, which must be set before torch first runs a kernel: the
`forklift` command and tests/conftest.py set them from this variable) it runs the AVX2 path
on an AVX-512 machine, so tests and benchmarks can cover both kinds.
"""

from __future__ import annotations

import functools
import os
import tempfile

CPU_KIND_ENV = "FORKLIFT_CPU_KIND"
# The kinds a CPU may be made to present itself as.
SIMULATED_KINDS = ("avx2",)
# Flags an AVX2-only x86-64 CPU lacks (prefixes of /proc/cpuinfo's names).
_BEYOND_AVX2 = ("avx512", "amx", "avx_vnni", "avx_ne_convert", "avx_ifma", "avx10")
# torch's own switches for the same caps; a process simulating a kind sets them before torch
# runs its first kernel (tests/conftest.py).
_TORCH_CAPS = {"avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}}


def simulated_cpu_kind() -> str | None:
    """The kind FORKLIFT_CPU_KIND asks for, or None; an unknown kind is a ValueError."""
    kind = os.environ.get(CPU_KIND_ENV, "").strip().lower()
    if not kind or kind == "native":
        return None
    if kind not in SIMULATED_KINDS:
        raise ValueError(
            f"{CPU_KIND_ENV} must be 'native' or one of {', '.join(SIMULATED_KINDS)}; got {kind!r}"
        )
    return kind


def torch_environment(kind: str) -> dict[str, str]:
    """The environment that caps torch at `kind`: ATen's and oneDNN's ISA, and an inductor
    cache of the kind's own (inductor's cache keys omit the cap: a kernel compiled for the
    host, loaded under the cap, computed garbage in torch 2.13)."""
    cache = os.path.join(tempfile.gettempdir(), f"torchinductor-forklift-{kind}")
    return {**_TORCH_CAPS[kind], "TORCHINDUCTOR_CACHE_DIR": cache}


@functools.cache
def host_cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_flags() -> frozenset[str]:
    """The flags the engine acts on: the host's, less what a simulated kind lacks."""
    flags = host_cpu_flags()
    if simulated_cpu_kind() == "avx2":
        flags = frozenset(f for f in flags if not f.startswith(_BEYOND_AVX2))
    return flags


def cpu_has_fast_bf16() -> bool:
    """AMX-BF16 or AVX512-BF16 make bf16 matmuls several times faster than fp32."""
    return bool(cpu_flags() & {"amx_bf16", "avx512_bf16"})


def native_arch_flags() -> tuple[str, ...]:
    """The compiler's target: this CPU, or the x86-64 level of a simulated kind. On an
    AVX-512 CPU the compiler's own loops (not the intrinsics) use 512-bit vectors too: GCC's
    tuning for recent ones stops them at 256 bits, and 512 ran the native decode step
    1.02-1.05x and the sampler 1.2x faster on Sapphire Rapids (vector-width-ab.md)."""
    if simulated_cpu_kind() == "avx2":
        return ("-march=x86-64-v3", "-mtune=native")
    if "avx512f" in cpu_flags():
        return ("-march=native", "-mprefer-vector-width=512")
    return ("-march=native",)
