"""FORKLIFT_CPU_KIND: an AVX-512 machine presenting itself as an AVX2-only one, and every
CPU-dependent choice following the flags the engine sees."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from forklift.config import EngineConfig
from forklift.cpu import (
    CPU_KIND_ENV,
    cpu_flags,
    cpu_has_fast_bf16,
    host_cpu_flags,
    native_arch_flags,
    simulated_cpu_kind,
    torch_environment,
)


def test_the_avx2_kind_drops_every_flag_beyond_avx2(monkeypatch):
    monkeypatch.setenv(CPU_KIND_ENV, "native")
    host = cpu_flags()
    assert host == host_cpu_flags()
    monkeypatch.setenv(CPU_KIND_ENV, "avx2")
    seen = cpu_flags()
    assert seen <= host
    assert not any(f.startswith(("avx512", "amx", "avx_vnni")) for f in seen)
    assert {"avx2", "fma"} & host <= seen  # what an AVX2 CPU has is kept
    assert not cpu_has_fast_bf16()
    assert native_arch_flags() == ("-march=x86-64-v3", "-mtune=native")
    assert EngineConfig().resolve_dtype(torch.device("cpu")) == torch.float32


def test_the_native_kind_follows_the_host(monkeypatch):
    monkeypatch.delenv(CPU_KIND_ENV, raising=False)
    wide = ("-mprefer-vector-width=512",) if "avx512f" in host_cpu_flags() else ()
    assert simulated_cpu_kind() is None and native_arch_flags() == ("-march=native", *wide)
    fast = bool(host_cpu_flags() & {"amx_bf16", "avx512_bf16"})
    assert cpu_has_fast_bf16() == fast
    want = torch.bfloat16 if fast else torch.float32
    assert EngineConfig().resolve_dtype(torch.device("cpu")) == want


def test_an_unknown_kind_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(CPU_KIND_ENV, "avx9000")
    with pytest.raises(ValueError, match=f"{CPU_KIND_ENV} must be 'native' or one of avx2"):
        cpu_flags()


def test_torch_is_capped_at_the_kind_in_a_fresh_process(tmp_path):
    """The caps the test suite sets from FORKLIFT_CPU_KIND reach ATen's dispatch, and
    inductor compiles into a cache of the kind's own."""
    env = {**torch_environment("avx2"), CPU_KIND_ENV: "avx2", "PATH": "/usr/bin:/bin"}
    assert env["TORCHINDUCTOR_CACHE_DIR"].endswith("torchinductor-forklift-avx2")
    code = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, check=True)  # fmt: skip
    assert done.stdout.strip() in ("AVX2", "DEFAULT")
