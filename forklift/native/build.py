"""Build and load this package's C kernels (native/csrc/*.c) with the system's C
compiler, once per machine.

A kernel is compiled for the CPU it runs on (`-march=native`) and linked against the
OpenMP runtime torch has already loaded, so its threads are torch's. The shared library is
kept in a cache directory under a name that hashes the source, the flags, the compiler and
the CPU, so an edited kernel, another compiler or another CPU model builds afresh. Where no
compiler works the loader returns None and callers keep their PyTorch kernels.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from forklift.cpu import native_arch_flags

logger = logging.getLogger("forklift")

NATIVE_SOURCE_DIR = Path(__file__).parent / "csrc"
# -Wno-psabi: the kernels' 64-byte vector types pass between inlined static functions only.
COMPILE_FLAGS = ("-O3", "-fopenmp", "-fPIC", "-shared", "-Wno-psabi")
# FORKLIFT_NATIVE_KERNELS=0 keeps every layer on its PyTorch kernels.
DISABLE_ENV = "FORKLIFT_NATIVE_KERNELS"


def native_kernels_enabled() -> bool:
    return os.environ.get(DISABLE_ENV, "1") != "0"


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "forklift" / "native"


def find_compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _cpu_identity() -> str:
    """What -march=native depends on: the CPU's model and flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


def _compiler_version(compiler: str) -> str:
    try:
        done = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout


def compile_flags(arch: tuple[str, ...] | None = None) -> tuple[str, ...]:
    """The fixed flags plus the target: `arch` where given (tests build each instruction
    set's path), else this CPU or the kind FORKLIFT_CPU_KIND simulates."""
    return (*COMPILE_FLAGS, *(native_arch_flags() if arch is None else arch))


def _sources(name: str) -> bytes:
    """The kernel's source and every header under csrc, isa/ included (a kernel may include
    any of them): each header's path and text, so an edited or moved header rebuilds."""
    parts = [(NATIVE_SOURCE_DIR / f"{name}.c").read_bytes()]
    for header in sorted(NATIVE_SOURCE_DIR.rglob("*.h")):
        parts += [header.relative_to(NATIVE_SOURCE_DIR).as_posix().encode(), header.read_bytes()]
    return b"\0".join(parts)


def library_path(name: str, compiler: str, arch: tuple[str, ...] | None = None) -> Path:
    source = _sources(name)
    digest = hashlib.sha256()
    flags = " ".join(compile_flags(arch)).encode()
    for part in (source, flags, _compiler_version(compiler).encode(), _cpu_identity().encode(),
                 platform.machine().encode()):  # fmt: skip
        digest.update(part)
        digest.update(b"\0")
    return cache_dir() / f"{name}-{digest.hexdigest()[:16]}.so"


def build_library(
    name: str, compiler: str, target: Path, arch: tuple[str, ...] | None = None
) -> None:
    """Compile native/csrc/<name>.c into `target`; the file appears whole or not at all
    (several processes of one server may build at once)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=target.parent, suffix=".so.partial")
    os.close(fd)
    try:
        source = str(NATIVE_SOURCE_DIR / f"{name}.c")
        command = [compiler, *compile_flags(arch), "-o", partial, source, "-lm"]
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(done.stderr.strip() or f"{compiler} exited {done.returncode}")
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def load_native_library(name: str, arch: tuple[str, ...] | None = None) -> ctypes.CDLL | None:
    """The compiled kernel library `name`, building it on first use; None (logged once per
    call) where native kernels are off, no compiler is found or the build fails."""
    if not native_kernels_enabled():
        return None
    compiler = find_compiler()
    if compiler is None:
        logger.info("no C compiler found: native %s kernel off", name)
        return None
    try:
        target = library_path(name, compiler, arch)
        if not target.exists():
            build_library(name, compiler, target, arch)
        return ctypes.CDLL(str(target))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        logger.warning("could not build the native %s kernel (%s); using PyTorch's", name, exc)
        return None
