"""A native library built from a git revision's C sources, for scripts that compare a
revision's kernels with this tree's side by side in one process."""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

from forklift.native.build import compile_flags, find_compiler

ROOT = Path(__file__).resolve().parents[2]
CSRC = "forklift/native/csrc"


def checkout_sources(revision: str, into: Path) -> Path:
    """The revision's native sources (every file of its csrc folder, subfolders such as isa/
    included) written into `into`."""
    into.mkdir(parents=True)
    listing = ["git", "ls-tree", "-r", "--name-only", f"{revision}:{CSRC}"]
    names = subprocess.run(listing, cwd=ROOT, check=True, capture_output=True,
                           text=True).stdout.split()  # fmt: skip
    for name in names:
        text = subprocess.run(["git", "show", f"{revision}:{CSRC}/{name}"], cwd=ROOT,
                              check=True, capture_output=True).stdout  # fmt: skip
        (into / name).parent.mkdir(parents=True, exist_ok=True)
        (into / name).write_bytes(text)
    return into


def build_library(
    source_dir: Path, name: str, target: Path, arch: tuple[str, ...] | None = None
) -> ctypes.CDLL:
    """Library `name` (its .c file in `source_dir`) compiled into `target` for this CPU, or
    for the target flags `arch` where given (as forklift.native.build takes them)."""
    compiler = find_compiler()
    assert compiler is not None, "no C compiler"
    command = [compiler, *compile_flags(arch), "-o", str(target),
               str(source_dir / f"{name}.c"), "-lm"]  # fmt: skip
    subprocess.run(command, check=True)
    return ctypes.CDLL(str(target))
